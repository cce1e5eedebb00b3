"""Pipelined prefill (issue #35, point 1): the time to first token of 1k / 3k / 6k-token
prompts on 2 stages against 1 process, each daemon pinned to its own core.

Every daemon runs under ``taskset -c K`` with ``--threads 1`` (one BLAS thread), so the
2-stage ring's cost is measured without the two stages fighting over a core; the
1-process baseline is one daemon pinned to core 0 the same way. Prefix cache off, so every
run prefills the whole prompt; 1 token out. Same run, same prompts. Also one request's
decode tokens/s (48 greedy tokens after a short prompt) on both, so a prefill change that
costs decode shows here.

Reported: TTFT seconds per setup and prompt length, and the ratio 2 stages / 1 process
(issue #35's goal: at most 0.55 at 3k tokens); each stage's busy time from the daemons'
own per-chunk timings is not available through the API, so the ratio is the figure.

Run: ``python bench/run.py bench_prefill_pipeline`` or ``python bench/bench_prefill_pipeline.py``
(needs 2 cores; nothing else should run meanwhile).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from ringlet.daemon.ops.demo import LocalCluster

LENGTHS = (1000, 3000, 6000)  # prompt tokens, about
RUNS = int(os.environ.get("BENCH_RUNS", "1"))
DECODE_TOKENS = 48


class PinnedCluster(LocalCluster):
    """A :class:`LocalCluster` whose node i runs under ``taskset -c i`` with ``--threads 1``."""

    def _command(self, i: int) -> list[str]:
        return ["taskset", "-c", str(i % (os.cpu_count() or 1))] + super()._command(i) + ["--threads", "1"]


def _prompt(tokens: int, salt: int) -> str:
    # " w<i>" is about 2.9 SmolLM2 tokens a word; a salt makes every prompt new
    return f"Run {salt}." + "".join(f" w{(i * 7919 + salt) % 100003}" for i in range(int(tokens / 2.9)))


def _ttft(url: str, text: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0}, timeout=1200)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens"]


def _decode_tps(url: str) -> float:
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": DECODE_TOKENS,
            "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def measure(stages: int, ranges: list[tuple[int, int]] | None = None, lengths=LENGTHS) -> dict:
    """TTFT per prompt length (median of RUNS) and decode tokens/s on ``stages`` pinned
    daemons (layer ``ranges``, default an even split)."""
    out: dict = {"stages": stages, "ranges": ranges, "ttft_s": {}, "prompt_tokens": {}}
    with PinnedCluster(stages, dtype="float32", extra_args=["--prefix-cache-bytes", "0"], ranges=ranges) as c:
        url = c.api_urls[-1]  # the last stage's API: the request goes through the whole ring
        _ttft(url, "Hi")  # the tokenizer, the first forward
        for n in lengths:
            runs = [_ttft(url, _prompt(n, 1000 * n + r)) for r in range(RUNS)]
            out["ttft_s"][n] = statistics.median(t for t, _ in runs)
            out["prompt_tokens"][n] = runs[0][1]
        out["decode_tokens_per_s"] = _decode_tps(url)
    return out


def main() -> dict:
    one, two = measure(1), measure(2)
    print(f"pinned cores, --threads 1, float32, prefix cache off, medians of {RUNS}")
    print(f"{'prompt':>8}{'1 process s':>13}{'2 stages s':>12}{'ratio':>7}")
    ratios = {}
    for n in LENGTHS:
        ratios[n] = two["ttft_s"][n] / one["ttft_s"][n]
        print(f"{one['prompt_tokens'][n]:>8}{one['ttft_s'][n]:>13.2f}{two['ttft_s'][n]:>12.2f}{ratios[n]:>7.2f}")
    print(f"decode tokens/s: 1 process {one['decode_tokens_per_s']:.2f}, 2 stages {two['decode_tokens_per_s']:.2f}")
    out = {"bench": "prefill_pipeline", "runs": RUNS, "one": one, "two": two, "ratio_two_to_one": ratios}
    Path(__file__).with_name("results_prefill_pipeline.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
