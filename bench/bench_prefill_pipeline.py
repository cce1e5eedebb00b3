"""Pipelined prefill (issue #35, point 1): the time to first token of 1k / 3k / 6k-token
prompts on 2 stages against 1 process, each daemon pinned to its own core.

Every daemon runs under ``taskset -c K`` with ``--threads 1`` (one BLAS thread), so the
2-stage ring's cost is measured without the two stages fighting over a core; the
1-process baseline is one daemon pinned to core 0 the same way. Prefix cache off, so every
run prefills the whole prompt; 1 token out. Same run, same prompts. Also one request's
decode tokens/s (48 greedy tokens after a short prompt) on both, so a prefill change that
costs decode shows here.

Two stages are measured on the splits the planner gives two equal nodes with
``--prefill-share`` 0 (decode balanced alone: ringlet before issue #35), 0.5 (the
default) and 1 (prefill alone), as static plans so that the probe's noise cannot move
them. Reported: TTFT seconds per setup and prompt length and the ratio 2 stages / 1
process (issue #35's goal: at most 0.55 at 3k tokens). ``BENCH_LENGTHS=1000,3000``
and ``BENCH_RUNS`` change what is measured.

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

from ringlet.daemon.engine.defaults import CPU_PREFILL_CHUNK
from ringlet.daemon.ops.demo import LocalCluster

LENGTHS = (1000, 3000, 6000)  # prompt tokens, about
RUNS = int(os.environ.get("BENCH_RUNS", "1"))
DECODE_TOKENS = 48


class PinnedCluster(LocalCluster):
    """A :class:`LocalCluster` whose node i runs under ``taskset -c i`` with ``--threads 1``."""

    def _command(self, i: int) -> list[str]:
        return ["taskset", "-c", str(i % (os.cpu_count() or 1))] + super()._command(i) + ["--threads", "1"]


_WORDS = ("the river stone light house garden window morning paper table green music quiet road "
          "winter summer bread water city field letter night market story friend train door "
          "mountain cloud apple voice forest ocean bridge tower candle pocket silver engine").split()


def _prompt(tokens: int, salt: int) -> str:
    """About ``tokens`` SmolLM2 tokens of common words (one token each), new for each ``salt``."""
    return f"Run {salt}:" + "".join(f" {_WORDS[(i * 7919 + salt) % len(_WORDS)]}" for i in range(tokens - 4))


def _ttft(url: str, text: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0}, timeout=1200)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens"]


def _decode_tps(url: str) -> float:
    """One request's decode tokens/s: streamed chunks after the first, over their time."""
    body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            "max_tokens": DECODE_TOKENS, "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (json.loads(line[6:]).get("choices") or [{}])[0].get(
                    "delta", {}).get("content"):
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def measure(stages: int, ranges: list[tuple[int, int]] | None = None, lengths=LENGTHS,
            chunk: int | None = None) -> dict:
    """TTFT per prompt length (median of RUNS) and decode tokens/s on ``stages`` pinned
    daemons (layer ``ranges``, default an even split; ``chunk`` prompt tokens a prefill
    chunk, default the daemon's)."""
    out: dict = {"stages": stages, "ranges": ranges, "chunk": chunk, "ttft_s": {}, "prompt_tokens": {}}
    args = ["--prefix-cache-bytes", "0"] + (["--prefill-chunk", str(chunk)] if chunk else [])
    with PinnedCluster(stages, dtype="float32", extra_args=args, ranges=ranges) as c:
        url = c.api_urls[-1]  # the last stage's API: the request goes through the whole ring
        _ttft(url, "Hi")  # the tokenizer, the first forward
        for n in lengths:
            runs = [_ttft(url, _prompt(n, 1000 * n + r)) for r in range(RUNS)]
            out["ttft_s"][n] = statistics.median(t for t, _ in runs)
            out["prompt_tokens"][n] = runs[0][1]
            print(f"  {stages} stage(s) {ranges or ''} chunk {chunk or 'default'}: {runs[0][1]} tokens, "
                  f"TTFT {out['ttft_s'][n]:.2f} s", flush=True)
        out["decode_tokens_per_s"] = _decode_tps(url)
    return out


#: the 2-stage splits of SmolLM2's 30 layers the planner gives 2 equal nodes with
#: --prefill-share 0 (decode alone, ringlet before issue #35), 0.5 (the default) and 1
SPLITS = {"share 0": [(0, 18), (18, 30)], "share 0.5": [(0, 16), (16, 30)], "share 1": [(0, 15), (15, 30)]}
#: a 2-stage ring's prefill takes about one stage's work plus one chunk's (the pipeline's
#: fill or drain), so a ring prefills in half the one-stage chunk (128 tokens on a CPU);
#: the default split with the one-stage chunk (what a ring used before) for comparison
ONE_STAGE_CHUNK = CPU_PREFILL_CHUNK


def main() -> dict:
    lengths = tuple(int(n) for n in os.environ.get("BENCH_LENGTHS", ",".join(map(str, LENGTHS))).split(","))
    one = measure(1, lengths=lengths)
    twos = {name: measure(2, ranges, lengths) for name, ranges in SPLITS.items()}
    twos[f"0.5, chunk {ONE_STAGE_CHUNK}"] = measure(2, SPLITS["share 0.5"], lengths, ONE_STAGE_CHUNK)
    print(f"pinned cores, --threads 1, float32, prefix cache off, medians of {RUNS}; TTFT s (ratio to 1 process)")
    print(f"{'prompt':>8}{'1 process':>11}" + "".join(f"{name:>18}" for name in twos))
    ratios: dict = {name: {} for name in twos}
    for n in lengths:
        row = f"{one['prompt_tokens'][n]:>8}{one['ttft_s'][n]:>11.2f}"
        for name, two in twos.items():
            ratios[name][n] = two["ttft_s"][n] / one["ttft_s"][n]
            row += f"{two['ttft_s'][n]:>11.2f} ({ratios[name][n]:.2f})"
        print(row)
    print(f"decode tokens/s, one request: 1 process {one['decode_tokens_per_s']:.2f}; "
          + "; ".join(f"{name} {two['decode_tokens_per_s']:.2f}" for name, two in twos.items()))
    out = {"bench": "prefill_pipeline", "runs": RUNS, "one": one, "two": twos, "ratio_two_to_one": ratios}
    Path(__file__).with_name("results_prefill_pipeline.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
