"""``make bench``: every benchmark in bench/, one after the other, each in the same run
as its baseline. Results go to ``bench/results_*.json`` and a summary to
``bench/results.json``. ``python bench/run.py NAME ...`` runs only the named ones.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

BENCHES = ["bench_spine", "bench_blas", "bench_cluster", "bench_planner", "bench_probes", "bench_shard", "bench_tp",
           "bench_concurrency", "bench_groups", "bench_prefill", "bench_chunk", "bench_prefix", "bench_hybrid",
           "bench_migration", "bench_agents", "bench_tool_stream", "bench_load", "bench_hub", "bench_prefill_pipeline",
           "bench_cache_kinds", "bench_spec", "bench_spec_tensor", "bench_few_rows", "bench_memory", "bench_models"]


def main(argv: list[str]) -> int:
    # Benchmarks that run MLX in this process do so as ringlet's processes do: on the
    # optimized BLAS, loaded before mlx.core (daemons they start load it themselves).
    from ringlet.daemon.probes import blas

    blas.load()
    sys.path.insert(0, str(Path(__file__).parent))
    wanted = argv or BENCHES
    summary, failed = {}, []
    for name in wanted:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                print(f"== {name}: not present, skipped")
                continue
            raise
        print(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            summary[name] = module.main()
        except Exception:  # one broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
        print(f"   ({time.perf_counter() - t0:.1f} s)")
    Path(__file__).with_name("results.json").write_text(json.dumps(summary, indent=1, default=str))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
