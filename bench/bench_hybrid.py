"""What a hybrid plan's stage costs: one stage run by a tensor group vs the same stage in process.

In a hybrid plan a group leader's engine sends each step to its group's rank 0 over the
control socket (hidden states as float32 bytes), rank 0 sends it to the other ranks over
the side channel, every rank runs its share, and the output comes back the same way
(``ringlet.daemon.tensor.group_stage``). This measures that path against the plain in-process
stage of a pipeline, on the same layers, in the same run, alternating round by round:

* ``inproc``: ``load_stage(model, 0, 15)``, called directly (what a pipeline stage runs);
* ``group1``: a 1-rank group holding layers [0, 15): the cost ringlet adds (two control
  socket round trips' worth of framing, float32 encoding, the rank's process hop) without
  any tensor parallelism;
* ``group3``: a 3-rank group (9 heads divide by 3) holding layers [0, 15) -- tensor
  parallel over MLX's ring on loopback. On this 2-core box 3 ranks share 2 cores (the poll
  shim of tests/tp_support.py keeps waiting ranks off the CPU), so this is not a fair
  measure of tensor parallelism; ``bench_tp`` is.

Per side: the median seconds of one decode step (1 token, after a 16-token prefill) and of
one 64-token prefill chunk, stage input -> stage output, float32 (the default model,
SmolLM2-135M, first half of its 30 layers). Also, on the 1-rank group: 4 requests' decode
steps as one batched step (``stage_forward([4 slots])``, KV caches merged into a
``BatchKVCache`` in the rank) against the same 4 steps one by one.

Usage: .venv/bin/python bench/bench_hybrid.py   (writes bench/results_hybrid.json; ``main() -> dict``)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LAYERS = (0, 15)
STEPS = 40
ROUNDS = 5
CHUNK = 64
BATCH = 4
OUT = Path(__file__).with_name("results_hybrid.json")


def main() -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from tp_support import rank_env

    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.engine.stage import load_stage
    from ringlet.daemon.tensor.group import TPGroup

    stage = load_stage(resolve(None), *LAYERS, "float32")
    prompt = list(range(100, 116))
    chunk = list(range(200, 200 + CHUNK))

    def inproc_round() -> tuple[list[float], float]:
        cache = make_prompt_cache(stage.model)
        mx.eval(stage(mx.array([prompt]), cache))
        steps = []
        for t in range(STEPS):
            t0 = time.perf_counter()
            mx.eval(stage(mx.array([[300 + t]]), cache))
            steps.append(time.perf_counter() - t0)
        cache = make_prompt_cache(stage.model)
        t0 = time.perf_counter()
        mx.eval(stage(mx.array([chunk]), cache))
        return steps, time.perf_counter() - t0

    async def group_round(group: TPGroup, slot: int) -> tuple[list[float], float]:
        epoch, _, _ = await group.stage_forward(slot, None, tokens=prompt)
        steps = []
        for t in range(STEPS):
            t0 = time.perf_counter()
            await group.stage_forward(slot, epoch, tokens=[300 + t])
            steps.append(time.perf_counter() - t0)
        group.free_slot(slot, epoch)
        t0 = time.perf_counter()
        e2, _, _ = await group.stage_forward(slot + 1, None, tokens=chunk)
        took = time.perf_counter() - t0
        group.free_slot(slot + 1, e2)
        return steps, took

    async def batch_round(group: TPGroup, base: int) -> tuple[float, float]:
        """Seconds per round of 4 decode steps: batched, then one by one (same caches' lengths)."""
        slots = [base + i for i in range(BATCH)]
        epoch = None
        for i, slot in enumerate(slots):  # prompts of different lengths: the batch is left-padded
            epoch, _, _ = await group.stage_forward(slot, None, tokens=prompt[: 8 + 2 * i])
        batched, single = [], []
        for t in range(STEPS // 4):
            t0 = time.perf_counter()
            await group.stage_forward(slots, epoch, tokens=[400 + t] * BATCH)
            batched.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for slot in slots:
                await group.stage_forward(slot, epoch, tokens=[500 + t])
            single.append(time.perf_counter() - t0)
        for slot in slots:
            group.free_slot(slot, epoch)
        return statistics.median(batched[1:]), statistics.median(single[1:])

    async def run() -> dict:
        g1 = TPGroup.local(None, 1, dtype="float32", layers=LAYERS, mode=None)
        g3 = TPGroup.local(None, 3, dtype="float32", layers=LAYERS, extra_env=rank_env(3), step_timeout=60)
        names = ("inproc", "group1", "group3")
        batch: dict[str, list[float]] = {"batched": [], "single": []}
        sides: dict[str, dict[str, list[float]]] = {k: {"step": [], "chunk": []} for k in names}
        try:
            await asyncio.gather(g1.start(), g3.start())
            slot = 0
            for _ in range(ROUNDS):
                for name in sides:
                    slot += 2
                    if name == "inproc":
                        steps, took = inproc_round()
                    else:
                        steps, took = await group_round(g1 if name == "group1" else g3, slot)
                    sides[name]["step"] += steps[2:]  # the first steps warm up
                    sides[name]["chunk"].append(took)
                slot += 10
                b, one = await batch_round(g1, slot)
                batch["batched"].append(b)
                batch["single"].append(one)
        finally:
            await asyncio.gather(g1.close(), g3.close())
        return sides, batch

    sides, batch = asyncio.run(run())
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in sides.items()}
    result = {
        "layers": list(LAYERS),
        "decode_step_s": {k: med[k]["step"] for k in med},
        "prefill_chunk_s": {k: med[k]["chunk"] for k in med},
        "group1_over_inproc_decode": med["group1"]["step"] / med["inproc"]["step"],
        "group1_added_ms_decode": (med["group1"]["step"] - med["inproc"]["step"]) * 1e3,
        "group1_over_inproc_chunk": med["group1"]["chunk"] / med["inproc"]["chunk"],
        "group3_over_inproc_decode": med["group3"]["step"] / med["inproc"]["step"],
        "group3_over_inproc_chunk": med["group3"]["chunk"] / med["inproc"]["chunk"],
        "group1_batch4_step_s": statistics.median(batch["batched"]),
        "group1_4_single_steps_s": statistics.median(batch["single"]),
        "group1_batch4_over_4_single": statistics.median(batch["batched"]) / statistics.median(batch["single"]),
        "note": "2-core box: group3 runs 3 ranks on 2 cores; compare ratios, not absolute times",
        "hidden_float32_bytes_per_decode_step": int(np.float32(0).nbytes * stage.hidden_size),
    }
    OUT.write_text(json.dumps(result, indent=1))
    for k in ("inproc", "group1", "group3"):
        print(f"  {k:7s} decode step {med[k]['step'] * 1e3:7.2f} ms   "
              f"{CHUNK}-token chunk {med[k]['chunk'] * 1e3:8.1f} ms")
    print(f"  group1/inproc: decode {result['group1_over_inproc_decode']:.2f}x "
          f"(+{result['group1_added_ms_decode']:.2f} ms), chunk {result['group1_over_inproc_chunk']:.2f}x; "
          f"group3/inproc: decode {result['group3_over_inproc_decode']:.2f}x, "
          f"chunk {result['group3_over_inproc_chunk']:.2f}x")
    print(f"  group1: 4 decode steps batched {result['group1_batch4_step_s'] * 1e3:.1f} ms vs one by one "
          f"{result['group1_4_single_steps_s'] * 1e3:.1f} ms ({result['group1_batch4_over_4_single']:.2f}x)")
    return result


if __name__ == "__main__":
    main()
