"""Tensor-parallel decode speed on this machine: N ranks (MLX ring over 127.0.0.1) vs 1 process.

Both sides run the same code path (``ringlet.daemon.tensor.group.TPGroup`` with its
``tp_worker`` processes; the 1-process group is the size-1 fallback). All groups of a
comparison are up at once -- an idle group costs nothing, its ranks sleep on their
control sockets -- and requests alternate between them round by round, so load from other
users of the machine falls on every side alike.

* decode tokens/s: greedy, ``TOKENS`` new tokens after a 16-token prompt, timed from the
  first to the last token (prefill excluded); median of ``RUNS`` requests;
* all-reduce: seconds per ``all_sum`` of one hidden-size float32 vector in the live group
  (``TPGroup.allreduce_seconds``), times the collectives per decoded token (2 per layer:
  attention output and MLP output; the next token ids travel on the side channel).

Models (random weights, llama architecture, built here):
* ``llama-1024-q4``: hidden 1024, 16 heads / 8 kv heads, MLP 2816, 8 layers, vocab 4096,
  4-bit (group 64) -- the form models are deployed in; compute bound on this CPU;
* ``llama-1024-f32``: the same in float32 -- memory-bandwidth bound: both cores share one
  memory bus, so splitting the weights gains little here;
* the default model (SmolLM2-135M, GGUF Q4_1 kept quantized) on 3 ranks, which its heads
  allow, on this 2-core box (more ranks than cores: the poll shim of tests/tp_support.py).

The 2-rank groups are also measured with that poll shim (``*_poll_shim``): MLX's ring
busy-waits in ``recv``, which costs a core whenever anything else (other users' work) wants
one; the shim shows what a sleeping wait would give. The product does not use it.

Usage: .venv/bin/python bench/bench_tp.py   (writes bench/results_tp.json; ``main() -> dict``)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

RESULTS = Path(__file__).resolve().parent / "results_tp.json"
TOKENS = 32
RUNS = 5
PROMPT = [1, 40, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]

BENCH_CONFIG = {
    "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816,
    "num_attention_heads": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "vocab_size": 4096,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def make_bench_model(directory: Path, bits: int | None) -> Path:
    """Random llama (BENCH_CONFIG) saved as an MLX directory, optionally quantized."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tiny_models import save_char_tokenizer

    config = dict(BENCH_CONFIG)
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = {k: (v + 0.02 * mx.random.normal(v.shape)).astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    model.load_weights(list(params.items()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    save_char_tokenizer(directory, config["vocab_size"])
    return directory


async def decode_rate(group) -> float:
    stamps = []
    async for _tok in group.generate(PROMPT, TOKENS):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def compare(name: str, model: str | None, ranks: int, dtype: str | None, variants: dict[str, dict]) -> dict:
    """Start a 1-process group and one N-rank group per variant (label -> extra rank environment),
    all at once (an idle group costs nothing: its ranks sleep on their control sockets), then
    alternate requests between them round by round so that other load hits every group alike."""
    from ringlet.daemon.tensor.group import TPGroup

    groups = {"1": TPGroup.local(model, 1, dtype=dtype, mode=None, step_timeout=120)}
    for label, env in variants.items():
        groups[label or "as shipped"] = TPGroup.local(model, ranks, dtype=dtype, extra_env=env, step_timeout=120)
    startup = {}
    try:
        for key, g in groups.items():
            t0 = time.perf_counter()
            await g.start()
            startup[key] = round(time.perf_counter() - t0, 2)
        rates: dict[str, list[float]] = {k: [] for k in groups}
        for _ in range(RUNS + 1):  # round 0 warms up
            for key, g in groups.items():
                rates[key].append(await decode_rate(g))
        layers = groups["1"].spec.num_layers
        rows = {}
        for key, g in groups.items():
            ar = await g.allreduce_seconds(iters=200) if key != "1" else 0.0
            info = g.info()
            r = statistics.median(rates[key][1:])
            per_token = (2 * layers) * ar if key != "1" else 0.0
            rows[key] = {
                "ranks": info["size"],
                "mode": info["mode"],
                "backend": info["backend"],
                "startup_s": startup[key],
                "decode_tok_s": round(r, 2),
                "decode_tok_s_runs": [round(x, 2) for x in rates[key][1:]],
                "allreduce_us": round(ar * 1e6, 1),
                "allreduces_per_token": 2 * layers if key != "1" else 0,
                "allreduce_ms_per_token": round(per_token * 1e3, 3),
                "allreduce_share_of_token": round(per_token * r, 3),
            }
    finally:
        for g in groups.values():
            await g.close()
    single = rows.pop("1")
    out = {"model": name, "dtype": dtype or "model", "ranks": ranks, "one_process": single}
    for key, r in rows.items():
        suffix = "" if key == "as shipped" else f"_{key}"
        out[f"{ranks}_ranks{suffix}"] = r
        out[f"ratio_vs_1{suffix}"] = round(r["decode_tok_s"] / single["decode_tok_s"], 3)
        print(
            f"{name:>24} {dtype or 'model':>7}: 1 process {single['decode_tok_s']:6.2f} tok/s | "
            f"{ranks} ranks {key:>10} {r['decode_tok_s']:6.2f} tok/s = {out[f'ratio_vs_1{suffix}']:.2f}x | "
            f"all_sum {r['allreduce_us']:.0f} us x {r['allreduces_per_token']} = "
            f"{r['allreduce_ms_per_token']:.2f} ms/token ({r['allreduce_share_of_token']:.0%} of a token)",
            flush=True,
        )
    return out


def main() -> dict:
    """Run every comparison, print a summary, write bench/results_tp.json, return the results."""
    from tp_support import poll_shim, rank_env

    results: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": os.getloadavg(),
        "method": "all groups up at once, requests alternating between them; greedy decode of "
        f"{TOKENS} tokens after a {len(PROMPT)}-token prompt, median of {RUNS} requests per group "
        "after one warm-up round, first-to-last token (prefill excluded)",
        "comparisons": [],
    }
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-tp-") as d:
        q4 = make_bench_model(Path(d) / "llama-1024-q4", bits=4)
        f32 = make_bench_model(Path(d) / "llama-1024-f32", bits=None)

        async def run_all() -> None:
            two = {"": {}}
            if poll_shim():
                two["poll_shim"] = {"LD_PRELOAD": poll_shim()}
            three = {"poll_shim" if rank_env(3) else "": rank_env(3)}
            results["comparisons"].append(await compare("llama-1024-q4 (random)", str(q4), 2, None, two))
            results["comparisons"].append(await compare("llama-1024-f32 (random)", str(f32), 2, "float32", two))
            results["comparisons"].append(await compare("smollm2-135m (Q4_1)", None, 3, None, three))

        asyncio.run(run_all())
    headline = results["comparisons"][0]
    results["headline"] = {
        "model": headline["model"],
        "ranks": 2,
        "ratio_vs_1": headline["ratio_vs_1"],
        "ratio_vs_1_poll_shim": headline.get("ratio_vs_1_poll_shim"),
        "goal": 1.3,
        "allreduce_us": headline["2_ranks"]["allreduce_us"],
        "allreduce_ms_per_token": headline["2_ranks"]["allreduce_ms_per_token"],
        "load_average_after": os.getloadavg(),
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
