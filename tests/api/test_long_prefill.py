"""Long prefills on a real daemon (issue #35): every API surface keeps a client with a
short read timeout connected (keepalives), streams prompt progress when asked, shows the
prefilling request in ``GET /v1/cluster``, and stops a prefill whose client left.

The daemon is slowed by the test-only ``RINGLET_TEST_PREFILL_CHUNK_DELAY_S`` (a wait after
each prefill chunk) so that a ~340-token prompt in 64-token chunks prefills for several
seconds whatever the machine; the keepalive interval is lowered to 1 s and the clients'
read timeout is 2.5 s, shorter than the prefill.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from ringlet.daemon.node.config import TEST_CHUNK_DELAY_ENV
from ringlet.daemon.ops.demo import LocalCluster

MODEL = "smollm2-135m"
CHUNK = 64  # tokens per prefill chunk
DELAY_S = 0.6  # added to each chunk's time: 6 chunks take > 3.6 s


def prompt(k: int) -> str:
    """A ~340-token prompt (with the chat template), different from the start for each
    ``k``: the prefix cache holds nothing of it for another test."""
    return f"List {k}. " + " ".join(f"item {i} is {(i * 7 + k) % 13}." for i in range(40))


READ_S = 2.5  # the clients' read timeout, seconds: shorter than the prefill
TIMEOUT = httpx.Timeout(connect=5, read=READ_S, write=5, pool=5)


def messages(k: int) -> list[dict]:
    return [{"role": "user", "content": prompt(k)}]


@pytest.fixture(scope="module")
def cluster():
    env = {"RINGLET_KEEPALIVE_S": "1", TEST_CHUNK_DELAY_ENV: str(DELAY_S)}
    with LocalCluster(1, dtype="float32", extra_args=["--prefill-chunk", str(CHUNK)], env=env) as c:
        yield c


@pytest.fixture(scope="module")
def url(cluster) -> str:
    """The daemon's API, its tokenizer built (a node's first request waits ~1 s for it)."""
    base = cluster.api_urls[0]
    httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
               timeout=60).raise_for_status()
    return base


def sse_lines(url: str, path: str, body: dict, until=None) -> list[tuple[float, str]]:
    """The non-empty lines of a streamed POST, each with its arrival time (s since the
    request); stops early (disconnects) when ``until(line)`` is true."""
    out = []
    t0 = time.monotonic()
    with httpx.Client(timeout=TIMEOUT) as client, client.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line:
                out.append((time.monotonic() - t0, line))
                if until is not None and until(line):
                    break
    return out


def data(lines) -> list[dict]:
    return [json.loads(line[6:]) for _, line in lines if line.startswith("data: {")]


def test_chat_official_client_survives_short_read_timeout(url):
    # a plain number of seconds, as the client documents: its HTTP library's own timeout type
    # differs between releases (openai 3.63 moved from httpx to httpx2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=READ_S)
    t0 = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=messages(1), max_tokens=4, temperature=0,
                                            stream=True)
    first = next(stream)
    assert first.choices[0].delta.role == "assistant" and time.monotonic() - t0 < READ_S  # at admission
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and time.monotonic() - t0 > READ_S + 0.5  # the prefill outlasted the read timeout


def test_completions_progress_and_cluster_midway(url):
    seen_midway = []

    def midway(line: str) -> bool:
        if '"prompt_progress"' in line and not seen_midway:
            progress = json.loads(line[6:])["prompt_progress"]
            if 0 < progress["processed"] < progress["total"]:
                seen_midway.extend(httpx.get(url + "/v1/cluster", timeout=5).json()["prefilling"])
        return False

    body = {"model": MODEL, "prompt": prompt(2), "max_tokens": 3, "temperature": 0, "stream": True,
            "return_progress": True}
    lines = sse_lines(url, "/v1/completions", body, until=midway)
    assert lines[0][1] == ": keepalive" and lines[0][0] < READ_S  # without echo: a comment at admission
    progress = [d["prompt_progress"] for d in data(lines) if "prompt_progress" in d]
    done = [p["processed"] for p in progress]
    assert done == sorted(done) and done[-1] == progress[0]["total"] and len(done) >= 5
    assert all(p["cache"] == 0 and p["time_ms"] >= 0 for p in progress)
    assert any(d.get("choices") and d["choices"][0]["text"] for d in data(lines))
    assert lines[-1][1] == "data: [DONE]"
    (entry,) = seen_midway
    assert 0 < entry["processed_tokens"] < entry["prompt_tokens"] == progress[0]["total"]
    assert entry["eta_s"] is not None and entry["eta_s"] > 0


def test_anthropic_pings_during_prefill(url):
    body = {"model": MODEL, "messages": messages(3), "max_tokens": 3, "stream": True, "temperature": 0}
    lines = sse_lines(url, "/v1/messages", body)
    events = [line[7:] for _, line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and lines[0][0] < READ_S
    assert events[:events.index("content_block_start")].count("ping") >= 3  # pings during the prefill
    assert events[-1] == "message_stop"
    gaps = [b[0] - a[0] for a, b in zip(lines, lines[1:], strict=False)]
    assert max(gaps) < READ_S


def test_responses_in_progress_during_prefill(url):
    body = {"model": MODEL, "input": prompt(4), "max_output_tokens": 3, "stream": True, "temperature": 0}
    lines = sse_lines(url, "/v1/responses", body)
    events = data(lines)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and lines[0][0] < READ_S
    assert kinds.count("response.in_progress") >= 3 and kinds[-1] == "response.incomplete"  # 3 tokens
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_disconnect_mid_prefill_stops_and_releases(url):
    def leave(line: str) -> bool:
        return '"prompt_progress"' in line and json.loads(line[6:])["prompt_progress"]["processed"] >= CHUNK

    body = {"model": MODEL, "messages": messages(5), "max_tokens": 3, "stream": True,
            "stream_options": {"include_progress": True}}
    sse_lines(url, "/v1/chat/completions", body, until=leave)
    left = time.monotonic()
    while True:
        info = httpx.get(url + "/v1/cluster", timeout=5).json()
        if not info["prefilling"] and not info["kv_caches"] and info["requests_in_flight"] == 0:
            break
        assert time.monotonic() - left < 2 * DELAY_S + 1.5, info["prefilling"]  # about one chunk
        time.sleep(0.1)
    last = info["recent_requests"][-1]
    assert last["completion_tokens"] == 0 and last["ttft_s"] is None  # stopped before its first token
    # the part prefilled was kept as a prefix entry: the same prompt again starts from it
    again = sse_lines(url, "/v1/chat/completions", body, until=lambda line: '"prompt_progress"' in line)
    (first,) = [d["prompt_progress"] for d in data(again) if "prompt_progress" in d]
    assert CHUNK <= first["cache"] < first["total"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_whole_reply_client_leaving_mid_prefill_stops_it(url, path):
    """A non-streamed request whose client gives up (a read timeout shorter than the
    prefill) is stopped within a keepalive interval and a chunk, on every surface."""
    k = {"/v1/chat/completions": 7, "/v1/messages": 8, "/v1/responses": 9}[path]
    body = ({"model": MODEL, "input": prompt(k), "max_output_tokens": 3} if path == "/v1/responses"
            else {"model": MODEL, "messages": messages(k), "max_tokens": 3})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, timeout=httpx.Timeout(connect=5, read=1.5, write=5, pool=5))
    left = time.monotonic()
    while True:
        info = httpx.get(url + "/v1/cluster", timeout=5).json()
        if not info["prefilling"] and not info["kv_caches"] and info["requests_in_flight"] == 0:
            break
        assert time.monotonic() - left < 1.0 + 2 * DELAY_S + 1.5, info["prefilling"]  # a keepalive and a chunk
        time.sleep(0.1)
    last = info["recent_requests"][-1]
    assert last["completion_tokens"] == 0 and last["ttft_s"] is None  # stopped before its first token
