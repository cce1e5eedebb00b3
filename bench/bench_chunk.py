"""Prefill chunk size on a CPU: the default there (256 tokens) against the GPU default
(512), same run, same prompt.

For 1 and 3 local daemons (float32, default model, prefix cache off so that every run
prefills the whole prompt), one request with a ~1,500-token prompt and 1 token out.
Reported per setting, medians of ``RUNS``: the time to first token (s) and the CPU
seconds all daemons spent on it. The ratios 256 / 512 are the figures to read.

Run: ``python bench/run.py bench_chunk`` or ``python bench/bench_chunk.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

from ringlet.daemon.engine.defaults import CPU_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK
from ringlet.daemon.ops.demo import LocalCluster

RUNS = 3
WORDS = 400  # " word<i>" x 400: ~1,500 tokens of SmolLM2's tokenizer


def _cpu_s(cluster: LocalCluster) -> float:
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in cluster.procs)


def measure(stages: int, chunk: int) -> dict:
    """TTFT (s) and daemon CPU (s) of a long prompt on ``stages`` daemons, medians of RUNS."""
    args = ["--prefill-chunk", str(chunk), "--prefix-cache-bytes", "0"]
    ttft, cpu, prompt_tokens = [], [], 0
    with LocalCluster(stages, dtype="float32", extra_args=args) as c:
        url = f"{c.api_urls[0]}/v1/completions"
        httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, timeout=300)  # tokenizer, first forward
        for run in range(RUNS):
            body = {"prompt": " ".join(f"word{i + run}" for i in range(WORDS)), "max_tokens": 1, "temperature": 0}
            before, t0 = _cpu_s(c), time.perf_counter()
            r = httpx.post(url, json=body, timeout=600).json()
            ttft.append(time.perf_counter() - t0)
            cpu.append(_cpu_s(c) - before)
            prompt_tokens = r["usage"]["prompt_tokens"]
    return {"stages": stages, "prefill_chunk": chunk, "prompt_tokens": prompt_tokens,
            "ttft_s": statistics.median(ttft), "cpu_s": statistics.median(cpu)}


def main() -> dict:
    rows, ratios = [], {}
    for stages in (1, 3):
        small, large = measure(stages, CPU_PREFILL_CHUNK), measure(stages, DEFAULT_PREFILL_CHUNK)
        rows += [small, large]
        ratios[stages] = {k: small[k] / large[k] for k in ("ttft_s", "cpu_s")}
    print(f"one request, {rows[0]['prompt_tokens']}-token prompt, float32, medians of {RUNS}")
    print(f"{'stages':>7}{'chunk':>7}{'TTFT s':>9}{'CPU s':>8}")
    for r in rows:
        print(f"{r['stages']:>7}{r['prefill_chunk']:>7}{r['ttft_s']:>9.2f}{r['cpu_s']:>8.2f}")
    for stages, q in ratios.items():
        print(f"{stages} stage(s), {CPU_PREFILL_CHUNK} / {DEFAULT_PREFILL_CHUNK}: TTFT x{q['ttft_s']:.2f}, "
              f"CPU x{q['cpu_s']:.2f}")
    out = {"bench": "chunk", "runs": RUNS, "results": rows, "ratio_small_to_large": ratios}
    Path(__file__).with_name("results_chunk.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
