"""Prefix-cache hit rate of a 5-turn chat on each mlx-lm cache kind (issue #33's closing
note), through real daemons: 3 daemons on loopback, a tiny random model per kind
(``tests/zoo_models.py`` configs, 6 layers, the character tokenizer's 98 ids), greedy,
prompts as token ids, each turn's prompt the previous turn's prompt and answer and 12
new tokens, 16 tokens an answer.

Kinds: ``KVCache`` (llama), ``RotatingKVCache`` windows beside ``KVCache`` (gpt_oss),
``ArraysCache`` recurrent states beside ``KVCache`` (qwen3_next), ``CacheList`` of a
state and KV in each layer (falcon_h1), length caches of layers that cache nothing beside
``KVCache`` (nemotron-nas) and beside states (nemotron_h), and recurrent states behind a
hop that carries two residual streams (rwkv7). A plain KVCache stage reuses any prefix; the
others reuse a state only at the length it was saved, the previous turn's end.

Per kind: turns served with cached tokens (of turns 2-5), and cached prompt tokens over
all prompt tokens of turns 2-5 (the most a turn can take is the previous turn's prompt
and answer but the answer's last token, which no stage computed).

Run: ``python bench/run.py bench_cache_kinds``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx

TESTS = Path(__file__).resolve().parent.parent / "tests"
KINDS = {"KVCache": "llama", "RotatingKVCache": "gpt_oss", "ArraysCache": "qwen3_next", "CacheList": "falcon_h1",
         # layers that cache nothing given length caches (cacheless.py), beside KV and beside states
         "length+KVCache": "nemotron-nas", "length+ArraysCache": "nemotron_h",
         # a hop of two residual streams (streams.py), recurrent states
         "2-stream hop": "rwkv7"}
TURNS = 5
NEW, ANSWER = 12, 16


def _config(arch: str) -> dict:
    from zoo_models import ZOO

    config = {**ZOO[arch], "num_hidden_layers": 6, "vocab_size": 98, "max_position_embeddings": 4096}
    if "layer_types" in config:
        config["layer_types"] = (config["layer_types"][:2]) * 3
    if "block_configs" in config:  # nemotron-nas: one block config a layer
        config["block_configs"] = (config["block_configs"] * 2)[:6]
    return config


def chat(url: str) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn."""
    prompt: list[int] = []
    out = []
    for turn in range(TURNS):
        prompt = prompt + [3 + (7 * turn + 5 * i) % 95 for i in range(NEW)]
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "return_token_ids": True})
        r.raise_for_status()
        body = r.json()
        out.append((len(prompt), body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        prompt = prompt + body["choices"][0]["token_ids"]
    return out


def main() -> dict:
    sys.path.insert(0, str(TESTS))
    from tiny_models import make_chat_model

    from ringlet.daemon.engine import cache_kinds
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.engine.stage import load_stage
    from ringlet.daemon.ops.demo import LocalCluster

    results = {}
    with TemporaryDirectory() as tmp:
        for kind, arch in KINDS.items():
            path = make_chat_model(arch, Path(tmp) / arch, _config(arch))
            kinds = sorted(set(cache_kinds.kinds(load_stage(resolve(str(path)), 0).make_cache())))
            with LocalCluster(3, model=str(path), dynamic=True) as c:
                c.wait_plan(stages=3)
                turns = chat(c.api_urls[0])
                stores = [c.cluster_info(i)["prefix_cache"] for i in range(3)]
            later = turns[1:]
            best = sum(turns[i][0] + ANSWER - 1 for i in range(TURNS - 1))  # what each later turn could take
            results[kind] = {
                "model": arch, "cache_kinds": kinds,
                "turns_hit": f"{sum(1 for _, cached in later if cached)}/{len(later)}",
                "cached_tokens": sum(cached for _, cached in later),
                "prompt_tokens": sum(p for p, _ in later),
                "hit_rate_tokens": round(sum(cached for _, cached in later) / sum(p for p, _ in later), 3),
                "of_reusable": round(sum(cached for _, cached in later) / best, 3),
                "exact_entries": [s["exact_entries"] for s in stores],
                "per_turn": turns,
            }
            print(f"{kind:16s} ({arch}, {'+'.join(kinds)}): turns hit {results[kind]['turns_hit']}, cached "
                  f"{results[kind]['cached_tokens']}/{results[kind]['prompt_tokens']} prompt tokens of turns 2-{TURNS} "
                  f"({results[kind]['hit_rate_tokens']:.1%}; {results[kind]['of_reusable']:.1%} of what was reusable)")
    Path(__file__).with_name("results_cache_kinds.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    from ringlet.daemon.probes import blas

    blas.load()
    main()
