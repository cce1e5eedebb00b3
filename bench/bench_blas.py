"""CPU engine benchmark (issue "Linux nodes at full speed"): one daemon, the bundled model,
in the same run under four settings, through the same HTTP API:

* ``reference BLAS, Q4``: ``RINGLET_BLAS=none --dtype native`` (ringlet before this work);
* ``reference BLAS, float32``: ``RINGLET_BLAS=none --dtype float32``;
* ``OpenBLAS, Q4``: ``--dtype native`` (MLX's quantized CPU matmul uses no BLAS);
* ``OpenBLAS, auto, sgemm only``: ``RINGLET_GEMV_FORWARD=0``, float32 with every
  matmul on OpenBLAS's sgemm (ringlet before decode's products went to sgemv);
* ``OpenBLAS, auto``: the default (``--dtype auto`` = float32 on this CPU; M == 1
  products through sgemv, :mod:`ringlet.daemon.probes.gemv_forward`).

Measured: decode tokens/s (48 tokens after a short prompt) and the TTFT of a ~500-token
prompt, the median of ``RUNS``; ratios against the first setting. The prefix cache is
off (``--prefix-cache-bytes 0``): every prefill is a whole prefill.

Run: ``python bench/run.py bench_blas`` or ``python bench/bench_blas.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from bench_spine import stream_times

from ringlet.daemon.ops.demo import LocalCluster

#: What the nodes ran before issue #15: MLX's bundled reference BLAS and the GGUF's own Q4
#: weights, as ``(environment, --dtype)``; bench_concurrency and bench_prefill measure it too.
BEFORE_ISSUE_15: tuple[dict[str, str], str] = ({"RINGLET_BLAS": "none"}, "native")
SETTINGS = [
    ("reference BLAS, Q4", *BEFORE_ISSUE_15),
    ("reference BLAS, float32", {"RINGLET_BLAS": "none"}, "float32"),
    ("OpenBLAS, Q4", {}, "native"),
    ("OpenBLAS, auto, sgemm only", {"RINGLET_GEMV_FORWARD": "0"}, "auto"),
    ("OpenBLAS, auto", {}, "auto"),
]
RUNS = 2
DECODE_TOKENS = 48
LONG_PROMPT = " ".join(f"Sentence {i} tells the reader about item {i} and its colour." for i in range(42))


def measure(env: dict[str, str], dtype: str) -> dict:
    """Median decode tokens/s and 500-token TTFT of one daemon under ``env`` and ``dtype``."""
    with LocalCluster(1, dtype=dtype, env=env, extra_args=["--prefix-cache-bytes", "0"]) as c:
        url = c.api_urls[0]
        stream_times(url, "Hello", 4)  # warm-up
        decode, ttft = [], []
        for _ in range(RUNS):
            t0 = time.perf_counter()
            times = stream_times(url, "Once upon a time", DECODE_TOKENS)
            decode.append((len(times) - 1) / (times[-1] - times[0]))
            t0 = time.perf_counter()
            times = stream_times(url, f"Run {len(ttft)}. " + LONG_PROMPT, 1)
            ttft.append(times[0] - t0)
        import httpx

        info = httpx.get(f"{url}/v1/cluster", timeout=10).json()
    return {"decode_tokens_per_s": statistics.median(decode), "ttft_500_s": statistics.median(ttft),
            "blas": info["blas"]["kind"] + (" + sgemv" if info["blas"].get("gemv_forward") else ""),
            "dtype": info["dtype"]["loaded"]}


def main() -> dict:
    results = {}
    for name, env, dtype in SETTINGS:
        results[name] = measure(env, dtype)
        print(f"  {name:28s} decode {results[name]['decode_tokens_per_s']:6.1f} tok/s   "
              f"TTFT(500 tok) {results[name]['ttft_500_s']:6.2f} s   [{results[name]['blas']}, "
              f"{results[name]['dtype']}]")
    base = results[SETTINGS[0][0]]
    for name in results:
        r = results[name]
        r["decode_ratio"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["prefill_ratio"] = base["ttft_500_s"] / r["ttft_500_s"]
        print(f"  {name:28s} decode x{r['decode_ratio']:.2f}   500-token prefill x{r['prefill_ratio']:.2f}")
    Path(__file__).with_name("results_blas.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
