"""Streamed tool calls (issue #32, point 5): how soon a forced call's arguments begin
to arrive against the time of the whole call, on 1 and 2 float32 daemons of the bundled
model, one cluster at a time.

For a greedy ``tool_choice: required`` chat (``get_weather``), streamed, each run
records from the request's start: the first token (``return_token_ids``), the first
``delta.tool_calls`` chunk (id and name), the first and the last ``function.arguments``
pieces, and the finish chunk, with the tokens generated before the first piece and in
all; and the same request not streamed (the whole call, as a client without streaming
waits for it).
Before the arguments were streamed, the first ``delta.tool_calls`` chunk came with all
of them, after the call's end marker: at about the finish chunk's time.

Run: ``python bench/run.py bench_tool_stream`` or ``python bench/bench_tool_stream.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
BODY = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0}
REPEATS = 5


def streamed(url: str) -> dict[str, float | int]:
    """Seconds from the request's start to each step of one streamed call, and its pieces."""
    t0 = time.perf_counter()
    out: dict[str, float | int] = {"pieces": 0, "tokens": 0}
    body = {**BODY, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            now = time.perf_counter() - t0
            for call in choice["delta"].get("tool_calls") or ():
                out.setdefault("call_start_s", now)
                if call["function"].get("arguments"):
                    out.setdefault("first_arguments_s", now)
                    out.setdefault("tokens_before_arguments", out["tokens"])
                    out["last_arguments_s"] = now
                    out["pieces"] += 1
            if choice.get("token_ids"):
                out.setdefault("first_token_s", now)
            out["tokens"] += len(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                out["finish_s"] = now
    return out


def whole(url: str) -> float:
    """Seconds for the same call not streamed."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=600)
    r.raise_for_status()
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    return time.perf_counter() - t0


def main() -> dict:
    from ringlet.daemon.ops.demo import LocalCluster

    out: dict = {}
    for stages in (1, 2):
        with LocalCluster(stages, dtype="float32") as c:
            url = c.api_urls[0]
            whole(url)  # warm-up: the tokenizer and the grammar's tokenizer are built on the first request
            runs, wholes = [], []
            for _ in range(REPEATS):  # interleaved, so that a busy moment of the machine hits both alike
                runs.append(streamed(url))
                wholes.append(whole(url))
            figures = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            figures["whole_call_s"] = statistics.median(wholes)
            figures["first_arguments_over_whole"] = figures["first_arguments_s"] / figures["whole_call_s"]
            out[f"{stages}_stages"] = figures
    print(json.dumps(out, indent=2))
    (Path(__file__).parent / "results_tool_stream.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    from ringlet.daemon.probes import blas

    blas.load()
    sys.exit(0 if main() else 1)
