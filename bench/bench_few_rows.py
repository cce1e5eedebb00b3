"""Few-row products (daemon/probes/gemv_forward.c): what a forward of M positions costs
against one of 1 position, with products of 2-8 rows on ringlet's kernel (the default)
and on OpenBLAS's sgemm (``RINGLET_FEW_ROWS=0``), on 1 and 2 BLAS threads.

M positions are what a verifying step of speculative decoding computes (the latest token
and M - 1 drafts) and what a decode group of M requests computes: the premise of
speculative decoding is that such a forward costs about one decode step, because it reads
the weights once. Measured: the bundled model (SmolLM2-135M, float32, whole, one process),
after a 200-token prefill, the best of 5 forwards of M positions (each trimmed from the
KV cache again with mlx-lm's ``trim_prompt_cache``), milliseconds, and the ratio to M = 1
in the same process. Each setting runs in a fresh process, the settings alternate.

Run: ``python bench/run.py bench_few_rows``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROWS = (1, 2, 3, 4, 5, 7, 8)
REPEATS = 2

CHILD = r"""
import json, sys, time
from ringlet.daemon.probes import blas
blas.load()
import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage
stage = load_stage(resolve("smollm2-135m"), 0, dtype="float32")
cache = stage.make_cache()
mx.eval(stage(mx.array([[10 + i % 1000 for i in range(200)]]), cache))
out = {}
for m in json.loads(sys.argv[1]):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(stage(mx.array([[5] * m]), cache))
        best = min(best, time.perf_counter() - start)
        trim_prompt_cache(cache, m)
    out[m] = best * 1e3
print(json.dumps(out))
"""


def measure(threads: int, few_rows: bool) -> dict[int, float]:
    env = {**os.environ, "RINGLET_THREADS": str(threads), "RINGLET_FEW_ROWS": "1" if few_rows else "0"}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(ROWS)], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def main() -> dict:
    results: dict = {}
    for threads in (1, 2):
        runs: dict[bool, list[dict[int, float]]] = {True: [], False: []}
        for rep in range(REPEATS):
            for few in ((True, False) if rep % 2 == 0 else (False, True)):
                runs[few].append(measure(threads, few))
        for few, label in ((False, "sgemm"), (True, "few-row kernel")):
            best = {m: min(r[m] for r in runs[few]) for m in ROWS}
            row = {m: {"ms": round(best[m], 1), "to_one_row": round(best[m] / best[1], 2)} for m in ROWS}
            results[f"{threads}_threads_{label}"] = row
            print(f"  {threads} thread(s), {label:15s} " + " ".join(
                f"M={m}: {best[m]:6.1f} ms ({best[m] / best[1]:.2f})" for m in ROWS), flush=True)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
