"""Planner benchmark: speed of ``make_plan`` and predicted per-token times by policy.

Measures
  * one plan for 64 nodes x 128 layers (goal <= 50 ms), with and without cabling;
  * the exact ring order for 10 nodes with mixed links (goal <= 1 s);
  * predicted seconds per token of ``memory`` (exo parity), ``balanced`` and ``latency``
    on the seed cluster (examples/seed_cluster.json) and a heterogeneous cluster
    (examples/hetero_cluster.json: M3 Ultra 819 GB/s, M4 Max 546 GB/s, M4 Pro 273 GB/s)
    for the example models (examples/models/*, specs from config.json alone).

Prints a table and writes bench/results_planner.json. ``main() -> dict`` for bench/run.py.
Run: ``.venv/bin/python bench/bench_planner.py``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from ringlet.daemon.engine.modelspec import model_spec_from_config
from ringlet.daemon.ops.plan import read_cluster
from ringlet.partitioning import Infeasible, LinkSpec, ModelSpec, NodeSpec, Policy, make_plan
from ringlet.partitioning.ring import Topology

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = Path(__file__).resolve().parent / "results_planner.json"
CONTEXT = 32768  # tokens of KV cache the example plans are sized for

# (memory bytes, bandwidth bytes/s, FLOP/s) of the three machine types used for the large cluster.
ULTRA = (496 * 2**30, 819e9, 28e12)
MAX = (112 * 2**30, 546e9, 17e12)
PRO = (56 * 2**30, 273e9, 9e12)


def _timed(fn, repeat: int = 7) -> tuple[float, float, object]:
    """(min, median) wall seconds over ``repeat`` runs, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), result


def bench_large() -> dict:
    """64 mixed nodes x 128 layers, uncabled and cabled in a TB5 ring (approximate ring order)."""
    layers = 128
    model = ModelSpec(
        layer_bytes=(6_000_000_000,) * layers,
        embedding_bytes=2_000_000_000,
        head_bytes=2_000_000_000,
        kv_bytes_per_token_per_layer=16_384,
        context_tokens=CONTEXT,
        flops_per_token_per_layer=2 * 3e9,
        activation_bytes_per_token=16_384,
        name="synthetic-128-layer",
    )
    types = [ULTRA, MAX, PRO]
    nodes = [NodeSpec(f"n{i:02d}", *types[i % 3]) for i in range(64)]
    rng = random.Random(0)
    ring = [n.node_id for n in nodes]
    rng.shuffle(ring)
    cabled = [LinkSpec(ring[i], ring[(i + 1) % 64], 10e9, 5e-5, "tb5") for i in range(64)]
    out = {}
    for label, links in (("uncabled", []), ("tb5_ring", cabled)):
        for policy in ("balanced", "memory", "latency"):
            best, median, plan = _timed(lambda links=links, policy=policy: make_plan(
                nodes, links, model, policy=Policy(name=policy)), repeat=3 if policy == "latency" else 7)
            out[f"{label}/{policy}"] = {
                "min_ms": best * 1e3,
                "median_ms": median * 1e3,
                "stages": len(plan.stages),
                "max_stage_time_ms": plan.max_stage_time_s * 1e3,
            }
    return out


def bench_exact_ring() -> dict:
    """Exact ring order (threshold search + Held-Karp) for 10 nodes with mixed links."""
    rng = random.Random(1)
    ids = [f"m{i}" for i in range(10)]
    links = [
        LinkSpec(a, b, rng.choice([5e9, 10e9, 2.5e9]), rng.choice([5e-5, 1e-4, 2e-4]))
        for i, a in enumerate(ids)
        for b in ids[i + 1:]
        if rng.random() < 0.5
    ]
    best, median, order = _timed(lambda: Topology(ids, links, Policy(), 16_384).best_order())
    # Worst case for the threshold search: a full mesh where every link has its own bandwidth.
    mesh = [
        LinkSpec(a, b, rng.uniform(1e9, 1e10), rng.uniform(1e-5, 1e-4))
        for i, a in enumerate(ids)
        for b in ids[i + 1:]
    ]
    mbest, mmedian, _ = _timed(lambda: Topology(ids, mesh, Policy(), 16_384).best_order())
    nodes = [NodeSpec(i, 128 * 2**30, 546e9, 17e12) for i in ids]
    model = ModelSpec((1_000_000_000,) * 80, 10**9, 10**9, 4096, CONTEXT, 2e9, activation_bytes_per_token=16_384)
    pbest, pmedian, plan = _timed(lambda: make_plan(nodes, links, model))
    return {
        "ring_min_ms": best * 1e3,
        "ring_median_ms": median * 1e3,
        "mesh_ring_min_ms": mbest * 1e3,
        "mesh_ring_median_ms": mmedian * 1e3,
        "plan_min_ms": pbest * 1e3,
        "plan_median_ms": pmedian * 1e3,
        "links": len(links),
        "ring_order": list(order),
    }


def bench_policies() -> dict:
    """Predicted per-token times of the three policies on the example clusters and models."""
    models = {
        "DeepSeek-V3-671B-8bit": EXAMPLES / "models" / "deepseek-v3-671b-8bit" / "config.json",
        "Kimi-K2-1T-4bit": EXAMPLES / "models" / "kimi-k2-1t-4bit" / "config.json",
        "Qwen3-235B-A22B-8bit": EXAMPLES / "models" / "qwen3-235b-a22b-8bit" / "config.json",
    }
    specs = {name: model_spec_from_config(path, context_tokens=CONTEXT, name=name) for name, path in models.items()}
    q4 = json.loads(models["Qwen3-235B-A22B-8bit"].read_text())
    q4["quantization"] = q4["quantization_config"] = {"group_size": 64, "bits": 4}
    specs["Qwen3-235B-A22B-4bit"] = model_spec_from_config(q4, context_tokens=CONTEXT, name="Qwen3-235B-A22B-4bit")
    out = {}
    for cluster in ("seed_cluster", "hetero_cluster"):
        nodes, links, overrides = read_cluster(EXAMPLES / f"{cluster}.json")
        for name, spec in specs.items():
            row = {}
            for policy in ("memory", "balanced", "latency"):
                try:
                    plan = make_plan(nodes, links, spec, policy=Policy(name=policy, **overrides))
                except Infeasible as exc:
                    row[policy] = {"infeasible": exc.message}
                    continue
                row[policy] = {
                    "max_stage_time_ms": plan.max_stage_time_s * 1e3,
                    "latency_ms": plan.latency_s * 1e3,
                    "throughput_bound_tokens_per_s": plan.throughput_tokens_per_s,
                    "stages": [list(r) for r in plan.ranges],
                }
            out[f"{cluster}/{name}"] = row
    return out


def main() -> dict:
    """Run every measurement, print a summary, write bench/results_planner.json, return the results."""
    results = {
        "context_tokens": CONTEXT,
        "large_64x128": bench_large(),
        "exact_ring_10": bench_exact_ring(),
        "policies": bench_policies(),
    }
    large = results["large_64x128"]
    ring = results["exact_ring_10"]
    results["goals"] = {
        "plan_64x128_ms<=50": large["uncabled/balanced"]["median_ms"] <= 50
        and large["tb5_ring/balanced"]["median_ms"] <= 50,
        "exact_ring_10_ms<=1000": max(ring["ring_median_ms"], ring["mesh_ring_median_ms"]) <= 1000,
    }
    _print(results)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _print(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=130)
    t = Table(title="planner speed (median of runs)", title_justify="left")
    for col in ("case", "median", "min", "stages"):
        t.add_column(col, justify="right" if col != "case" else "left")
    for key, v in results["large_64x128"].items():
        t.add_row(f"64 nodes x 128 layers, {key}", f"{v['median_ms']:.1f} ms", f"{v['min_ms']:.1f} ms",
                  str(v["stages"]))
    r = results["exact_ring_10"]
    t.add_row(f"exact ring order, 10 nodes, {r['links']} links", f"{r['ring_median_ms']:.1f} ms",
              f"{r['ring_min_ms']:.1f} ms", "")
    t.add_row("exact ring order, 10 nodes, full mesh, 45 distinct links", f"{r['mesh_ring_median_ms']:.1f} ms",
              f"{r['mesh_ring_min_ms']:.1f} ms", "")
    t.add_row("full plan, 10 nodes x 80 layers", f"{r['plan_median_ms']:.1f} ms", f"{r['plan_min_ms']:.1f} ms", "")
    console.print(t)
    p = Table(title=f"predicted ms per token at {results['context_tokens']} tokens of context "
                    "(slowest stage = pipeline bound; one request = stages + hops)", title_justify="left")
    for col in ("cluster / model", "memory (exo)", "balanced", "latency", "balanced vs memory"):
        p.add_column(col, justify="left" if col.startswith("cluster") else "right")
    for key, row in results["policies"].items():
        cells = []
        for policy in ("memory", "balanced", "latency"):
            v = row[policy]
            if "infeasible" in v:
                cells.append("does not fit")
            else:
                cells.append(f"{v['max_stage_time_ms']:.2f} / {v['latency_ms']:.2f}")
        gain = ""
        if "infeasible" not in row["memory"] and "infeasible" not in row["balanced"]:
            gain = f"{row['memory']['max_stage_time_ms'] / row['balanced']['max_stage_time_ms']:.2f}x"
        p.add_row(key, *cells, gain)
    console.print(p)
    console.print("cells: slowest stage / one request, ms per token; goals: " + ", ".join(
        f"{k}: {'met' if v else 'MISSED'}" for k, v in results["goals"].items()))


if __name__ == "__main__":
    main()
