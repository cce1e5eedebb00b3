"""Decode groups (``daemon/engine/decode_groups.py``): one stage's batched decode step in
this process, with the batch's KV caches merged into mlx-lm's ``BatchKVCache`` and
split back on every step (what ringlet did before: ``BatchKVCache.merge`` + ``extract``)
against a kept group, at 60 and 1,000 tokens of context per request, for 1, 2, 4 and 8
requests. The reference is one request alone on its own ``KVCache``.

Stage: layers [0, 18) of the default model (SmolLM2-135M GGUF) in float32, as stage 0
of bench_concurrency's 2-stage plan runs it, on one BLAS thread (2 daemons on this
2-core machine get one each). Each figure: the median of 12 steps after 2 warm-up ones
(every setting starts from the same prefilled caches and grows them by the same 14 tokens).

Run: ``python bench/run.py bench_groups`` or ``python bench/bench_groups.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

CONTEXTS = (60, 1000)
BATCHES = (1, 2, 4, 8)
STEPS = 12


def _median_step(run) -> float:
    times = []
    for i in range(STEPS + 2):
        t0 = time.perf_counter()
        run()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _clone(cache: list) -> list:
    """The same KV in new ``KVCache`` objects (MLX arrays are immutable: an update makes a
    new array, so sharing them is safe)."""
    from ringlet.daemon.engine.prefix_store import caches_from

    return caches_from([(c.keys, c.values) for c in cache], cache[0].offset)


def _alone(stage, x, cache: list) -> float:
    import mlx.core as mx

    return _median_step(lambda: mx.eval(stage(x, cache)))


def _merged_each_step(stage, x, caches: list[list]) -> float:
    """Merge into ``BatchKVCache``s, step, split back: every step (ringlet before groups)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    def step() -> None:
        merged = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
        mx.eval(stage(x, merged))
        for row, cache in enumerate(caches):
            cache[:] = [c.extract(row) for c in merged]

    return _median_step(step)


def _kept_group(stage, x, caches: list[list]) -> float:
    from ringlet.daemon.engine.decode_groups import DecodeGroups
    from ringlet.daemon.engine.stage import mergeable

    groups, keys = DecodeGroups(), list(range(len(caches)))
    return _median_step(lambda: groups.forward(stage, keys, x, caches, mergeable))


def main() -> dict:
    from ringlet.daemon.probes import blas

    blas.load(1)
    import mlx.core as mx

    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.engine.stage import load_stage

    stage = load_stage(resolve(None), 0, 18, "float32")
    results: dict = {}
    for context in CONTEXTS:
        caches = []
        for r in range(max(BATCHES)):
            cache = stage.make_cache()
            mx.eval(stage(mx.array([[(7 * r + j) % 1000 + 1 for j in range(context)]], dtype=mx.int32), cache))
            caches.append(cache)
        alone = _alone(stage, mx.array([[5]], dtype=mx.int32), _clone(caches[0]))
        results[f"{context}/1"] = {"alone_ms": alone * 1e3}
        print(f"   context {context:5d}, 1 request alone: {alone * 1e3:6.1f} ms")
        for n in BATCHES[1:]:
            x = mx.array([[5]] * n, dtype=mx.int32)
            before = _merged_each_step(stage, x, [_clone(c) for c in caches[:n]])
            after = _kept_group(stage, x, [_clone(c) for c in caches[:n]])
            results[f"{context}/{n}"] = {"merged_each_step_ms": before * 1e3, "kept_group_ms": after * 1e3,
                                         "speedup": before / after, "per_token_vs_alone": after / n / alone}
            print(f"   context {context:5d}, {n} requests: merged+split each step {before * 1e3:6.1f} ms, "
                  f"kept group {after * 1e3:6.1f} ms ({before / after:.2f}x); per token {after / n / alone:.2f} "
                  "of one request alone")
    Path(__file__).with_name("results_groups.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
