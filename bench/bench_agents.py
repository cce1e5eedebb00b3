"""Agent API benchmark (issue "An API that agents can drive"), in one run, on 2 float32
daemons of the bundled model:

1. Decode tokens/s of a ``json_schema``-constrained reply against an unconstrained one
   of the same length (the constrained one is a long JSON array; the free one is cut at
   the same token count with ``max_tokens``). Goal: >= 0.95x.
2. The grammar's own cost per step: llguidance's mask for that schema, computed in
   this process, against the time of one decode step.
3. Time to the first ``delta.tool_calls`` chunk of a forced call against the first
   content token of the same prompt without tools. The first chunk names the call once
   its arguments begin; they follow as they are generated (bench_tool_stream.py).

Run: ``python bench/run.py bench_agents`` or ``python bench/bench_agents.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

LIST = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "minItems": 40, "maxItems": 40}},
        "required": ["words"], "additionalProperties": False}
ASK = [{"role": "user", "content": "List forty English words as JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REPEATS = 5


def stream(url: str, body: dict) -> tuple[float, float | None, float | None, int, list[float]]:
    """(start, first content time, first tool-call time, completion tokens, content chunk times)
    of one streamed greedy chat."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    t0, first_text, first_call, tokens = time.perf_counter(), None, None, 0
    times = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            for choice in payload.get("choices", []):
                now = time.perf_counter()
                if choice["delta"].get("content"):
                    first_text = first_text or now
                    times.append(now)
                if choice["delta"].get("tool_calls"):
                    first_call = first_call or now
    return t0, first_text, first_call, tokens, times


def decode_rate(url: str, body: dict) -> tuple[float, int]:
    """(decode tokens/s after the first token, completion tokens) of one request."""
    _, first, _, tokens, times = stream(url, body)
    return (tokens - 1) / (times[-1] - first), tokens


def mask_cost(steps: int = 200) -> float:
    """Seconds per llguidance mask for :data:`LIST`, this process, SmolLM2's vocabulary."""
    from ringlet.daemon.engine import grammar
    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    tok = load_tokenizer(resolve(None))
    width = len(tok)
    constraint = grammar.Constraint(grammar.json_schema_grammar(LIST), grammar.ll_tokenizer(tok._tokenizer, width),
                                    width)
    text = tok.encode('{"words":[' + ",".join(f'"w{i}"' for i in range(40)) + "]}", add_special_tokens=False)
    t0 = time.perf_counter()
    for t in text[:steps]:
        constraint.allowed()
        constraint.consume(t)
    return (time.perf_counter() - t0) / min(steps, len(text))


def main() -> dict:
    from ringlet.daemon.ops.demo import LocalCluster

    out: dict = {}
    with LocalCluster(2, dtype="float32") as c:
        url = c.api_urls[0]
        constrained = {"messages": ASK, "max_tokens": 200,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": LIST}}}
        stream(url, constrained)  # warm-up: the grammar's tokenizer is built on the first request
        rates, free = [], []
        for _ in range(REPEATS):  # interleaved, so that a busy moment of the machine hits both alike
            rate, length = decode_rate(url, constrained)
            rates.append(rate)
            free.append(decode_rate(url, {"messages": ASK, "max_tokens": length})[0])
        out["decode_tokens_per_s"] = {"json_schema": statistics.median(rates), "free": statistics.median(free),
                                      "tokens": length}
        out["decode_ratio"] = out["decode_tokens_per_s"]["json_schema"] / out["decode_tokens_per_s"]["free"]
        step_s = 1 / out["decode_tokens_per_s"]["free"]
        out["mask_s_per_step"] = mask_cost()
        out["mask_share_of_step"] = out["mask_s_per_step"] / step_s
        calls, texts = [], []
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        for _ in range(REPEATS):
            t0, _, first_call, _, _ = stream(url, {"messages": question, "max_tokens": 40, "tools": [WEATHER],
                                                   "tool_choice": "required", "parallel_tool_calls": False})
            calls.append(first_call - t0)
            t0, first_text, _, _, _ = stream(url, {"messages": question, "max_tokens": 8})
            texts.append(first_text - t0)
        out["first_tool_call_delta_s"] = statistics.median(calls)
        out["first_content_token_s"] = statistics.median(texts)
        out["tool_call_over_content"] = out["first_tool_call_delta_s"] / out["first_content_token_s"]
    print(json.dumps(out, indent=2))
    (Path(__file__).parent / "results_agents.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    from ringlet.daemon.probes import blas

    blas.load()
    sys.exit(0 if main() else 1)
