"""``/metrics`` (#44 must-have 3): after known traffic through the real clients, the
Prometheus text parsed with prometheus_client's own parser counts exactly it — requests by
surface and status, tokens as the responses' usage reported them, one time-to-first-token
sample per answered generation — and carries the node's figures; with API keys set it
wants one, like /v1/*."""

from __future__ import annotations

import anthropic
import httpx
import openai
from conftest import keyed_cluster
from prometheus_client.parser import text_string_to_metric_families

KEY = "metrics-test-key-" + "m" * 24
MODEL = "smollm2-135m"


def scrape(url: str, key: str | None = KEY) -> dict[tuple[str, tuple], float]:
    resp = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=")  # the text exposition format
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def test_metrics_count_the_traffic_sent_and_show_the_node(tmp_path):
    with keyed_cluster(tmp_path, KEY, dynamic=True) as c:
        url = c.api_urls[0]
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401  # a key, as for /v1/*
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        ask = [{"role": "user", "content": "Name a colour."}]
        one = oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=6, temperature=0)
        chunks = list(oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
        streamed = chunks[-1].usage
        msg = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ask, extra_body={"temperature": 0})
        bad = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=30,
                         json={"model": MODEL, "messages": ask, "temperature": 7})
        assert bad.status_code == 400
        m = scrape(url)

        def value(name: str, **labels) -> float:
            return m.get((name, tuple(sorted(labels.items()))), 0.0)

        assert value("ringlet_requests_total", surface="openai", status="200") == 2
        assert value("ringlet_requests_total", surface="anthropic", status="200") == 1
        assert value("ringlet_requests_total", surface="openai", status="400") == 1
        prompt = one.usage.prompt_tokens + streamed.prompt_tokens + msg.usage.input_tokens \
            + msg.usage.cache_read_input_tokens
        completion = one.usage.completion_tokens + streamed.completion_tokens + msg.usage.output_tokens
        assert value("ringlet_tokens_total", kind="prompt") == prompt
        assert value("ringlet_tokens_total", kind="completion") == completion
        assert value("ringlet_tokens_total", kind="cached") == msg.usage.cache_read_input_tokens + (
            one.usage.prompt_tokens_details.cached_tokens + streamed.prompt_tokens_details.cached_tokens)
        assert value("ringlet_time_to_first_token_seconds_count") == 3
        assert value("ringlet_inter_token_latency_seconds_count") >= completion - 3 - 3  # a few tokens per output
        assert value("ringlet_plan_epoch") >= 1 and value("ringlet_members") == 1
        assert value("ringlet_plans_committed_total") >= 1
        assert value("ringlet_memory_bytes", kind="weights") > 100e6  # 538 MB of float32 weights
        assert value("ringlet_memory_usable_bytes") > value("ringlet_memory_bytes", kind="weights")
        assert value("ringlet_stage_step_seconds_count") >= completion  # one round per decode step at least
        assert value("ringlet_prefix_cache_lookups_total", result="hit") >= 1  # the same prompt again
        assert value("ringlet_queue_length", where="api") == 0
        assert value("ringlet_requests_in_flight") == 0
