"""Stage load benchmark (issue "Linux nodes at full speed"): the bundled model's whole
stage (30 layers, Q4_1 GGUF dequantized to float32, 538 MB) loaded in the same run

* with the dequantized-weights cache off (``RINGLET_WEIGHTS_CACHE_BYTES=0``: every load
  dequantizes, ringlet before the cache);
* into an empty cache (dequantize, then write one safetensors file per layer);
* from a warm cache (read only);

each in a fresh process (the imports are done first and not counted), the median of
``RUNS``: wall and CPU seconds, ratios against the cache off. Then one ``ringlet run``
daemon, started to ready with the cache off and warm (median of ``RUNS``).

Run: ``python bench/run.py bench_load`` or ``python bench/bench_load.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = 3
_CHILD = """
import json, resource, time
from ringlet.daemon.probes import blas
blas.load()
import mlx_lm.models.llama  # imports are not part of the load
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
location = resolve(None)
c0, t0 = cpu(), time.perf_counter()
load_stage(location, 0, 30, dtype="float32")
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0}))
"""


def _load(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _daemon_start(env: dict[str, str]) -> float:
    from ringlet.daemon.ops.demo import LocalCluster

    t0 = time.perf_counter()
    with LocalCluster(1, dtype="float32", env=env, extra_args=["--no-dashboard"]):
        return time.perf_counter() - t0


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-load-") as home:
        off = {"XDG_CACHE_HOME": home, "RINGLET_WEIGHTS_CACHE_BYTES": "0"}
        on = {"XDG_CACHE_HOME": home, "RINGLET_WEIGHTS_CACHE_BYTES": str(32 * 10**9)}
        _load(off)  # the GGUF index and tokenizer caches of this home, built once
        results = {"cache off": _median([_load(off) for _ in range(RUNS)])}
        cold = []
        for _ in range(RUNS):
            for f in Path(home, "ringlet", "dequant").glob("*/*/*.safetensors"):
                f.unlink()
            cold.append(_load(on))
        results["empty cache (writes)"] = _median(cold)
        results["warm cache"] = _median([_load(on) for _ in range(RUNS)])
        base = results["cache off"]
        for name, r in results.items():
            r["wall_ratio"] = r["wall_s"] / base["wall_s"]
            r["cpu_ratio"] = r["cpu_s"] / base["cpu_s"]
            print(f"   {name:22s} load {r['wall_s']:.2f} s wall ({r['wall_ratio']:.2f}x), "
                  f"{r['cpu_s']:.2f} s CPU ({r['cpu_ratio']:.2f}x)")
        starts = {"cache off": statistics.median(_daemon_start(off) for _ in range(RUNS)),
                  "warm cache": statistics.median(_daemon_start(on) for _ in range(RUNS))}
        print(f"   daemon start to ready: cache off {starts['cache off']:.2f} s, warm {starts['warm cache']:.2f} s "
              f"({starts['warm cache'] / starts['cache off']:.2f}x)")
    out = {"load": results, "daemon_start_s": starts}
    Path(__file__).with_name("results_load.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
