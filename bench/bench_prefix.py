"""Prefix cache benchmark (issue "Conversations stay in the ring"), in one run:

1. A 10-turn chat on 3 daemons: a ~1,000-token system prompt, ~50 new tokens a turn.
   TTFT of every turn with the prefix cache and on a cluster without it
   (``--prefix-cache-bytes 0``), and the TTFT of a prompt made of turn 10's new tokens
   only (the floor a cached turn can reach). Goals: turn 10 >= 10x faster with the
   cache; within 1.3x of the new-tokens-only prompt.
2. 8 concurrent requests sharing a 4,000-token prefix with different suffixes, after
   one request that put the prefix in the stores: the mean TTFT with the cache against
   without.
3. Memory per cached token per stage (``/v1/cluster`` prefix_cache bytes / tokens)
   against the model's KV bytes per token for that stage's layers (2 x kv_heads x
   head_dim x 4 bytes x layers, float32). Goal: within 10 %.

4. The disk tier: TTFT of a turn served from disk, from memory and uncached, and after
   restarting every daemon.
5. Tensor mode: a 3-turn chat with the ~1,000-token system prompt on 3 daemons of one
   tensor group (rank 0 keeps the index, every rank its KV shards), TTFT of each turn
   with the cache and without (``--prefix-cache-bytes 0``).

Run: ``python bench/run.py bench_prefix`` or ``python bench/bench_prefix.py``.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from ringlet.daemon.ops.demo import LocalCluster

SYSTEM = " ".join(f"Rule {i}: when the user asks about subject {i}, answer in one short sentence." for i in range(62))
TURN = ("Now tell me, in a few words, something true and interesting about the number {n}, about the "
        "history of the city numbered {n} in my list, and whether {n} is a prime number or not, please.")
TURNS = 10
SHARED = " ".join(f"Section {i} of the shared document describes part {i} of the system in detail." for i in range(270))
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 3 * 64 * 4  # SmolLM2-135M: 3 KV heads of 64, float32


def ttft(url: str, messages: list[dict], max_tokens: int = 8) -> tuple[float, str, dict]:
    """(TTFT s, answer, usage) of one streamed greedy chat turn."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    return (first or time.perf_counter()) - t0, "".join(text), usage


def chat(url: str) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) of each of the TURNS turns."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for n in range(TURNS):
        messages.append({"role": "user", "content": TURN.format(n=n + 1)})
        t, answer, usage = ttft(url, messages)
        out.append((t, usage.get("prompt_tokens", 0), usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)))
        messages.append({"role": "assistant", "content": answer})
    return out


def concurrent_ttft(url: str) -> float:
    """Mean TTFT of 8 concurrent requests sharing the SHARED prefix (primed once first)."""
    ttft(url, [{"role": "user", "content": SHARED + " Question 0: summarise."}], max_tokens=1)
    times: list[float] = []

    def one(i: int) -> None:
        times.append(ttft(url, [{"role": "user", "content": SHARED + f" Question {i + 1}: what is part {i}?"}],
                          max_tokens=1)[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.mean(times)


def disk_tier(cold_url: str) -> dict:
    """TTFT of a turn whose prefix the disk tier serves, against the same turn served from
    memory and on a cluster without the cache; and after restarting both daemons. 2
    daemons whose memory store holds one ~1,100-token conversation, with a 1 GB disk tier."""
    per_token = 15 * KV_BYTES_PER_TOKEN_PER_LAYER  # a stage of 15 layers
    args = ["--prefix-cache-bytes", str(1600 * per_token), "--prefix-cache-disk-bytes", "1GB"]
    with LocalCluster(2, extra_args=args) as c:
        url = c.api_urls[0]
        conv_a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN.format(n=1)}]
        conv_b = [{"role": "system", "content": "Be brief. " + SYSTEM}, {"role": "user", "content": TURN.format(n=2)}]
        _, answer, _ = ttft(url, conv_a)
        ttft(url, conv_b)  # A's entry is evicted from memory to disk for B's
        conv_a += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURN.format(n=3)}]
        from_disk, answer, usage = ttft(url, conv_a)
        in_memory, _, _ = ttft(url, conv_a[:-1] + [{"role": "user", "content": TURN.format(n=4)}])
        uncached, _, _ = ttft(cold_url, conv_a)
        for i in range(2):
            c.kill(i, signal.SIGTERM)  # the entries in memory are written to the tier too
        for i in range(2):
            c.restart(i)
        conv_a += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURN.format(n=5)}]
        after_restart, _, restart_usage = ttft(url, conv_a)
    out = {"prompt_tokens": usage.get("prompt_tokens"), "ttft_disk_hit_s": from_disk, "ttft_memory_hit_s": in_memory,
           "ttft_uncached_s": uncached, "ttft_disk_hit_after_restart_s": after_restart,
           "cached_after_restart": restart_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}
    print(f"  disk tier, {out['prompt_tokens']}-token turn: TTFT {from_disk:.2f} s from disk, {in_memory:.2f} s "
          f"from memory, {uncached:.2f} s uncached (x{uncached / from_disk:.1f}); after restarting both daemons "
          f"{after_restart:.2f} s with {out['cached_after_restart']} tokens cached")
    return out


def tensor_mode() -> dict:
    """TTFT of 3 chat turns in tensor mode (3 ranks, float32), with the group's prefix cache
    and without. More ranks than this machine's 2 cores: the poll shim of
    tests/tp_support.py lets waiting ranks sleep (as bench_tp does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tp_support import poll_shim

    shim = poll_shim()
    env = {"RINGLET_TP_LD_PRELOAD": shim} if shim else {}
    runs: dict[str, list] = {}
    args = ["--mode", "tensor"]
    for name, extra in (("cached", []), ("uncached", ["--prefix-cache-bytes", "0"])):
        with LocalCluster(3, dtype="float32", dynamic=True, extra_args=[*args, *extra], env=env) as c:
            c.wait_plan(stages=3)
            messages, turns = [{"role": "system", "content": SYSTEM}], []
            for n in range(3):
                messages.append({"role": "user", "content": TURN.format(n=n + 1)})
                t, answer, usage = ttft(c.api_urls[0], messages)
                turns.append((t, usage.get("prompt_tokens", 0),
                              usage.get("prompt_tokens_details", {}).get("cached_tokens", 0), answer))
                messages.append({"role": "assistant", "content": answer})
            runs[name] = turns
            mode = c.cluster_info(0)["mode"]
            if mode != "tensor":  # the group gave up: these are not tensor-mode figures
                raise RuntimeError(f"the cluster fell back to {mode} mode: {c.cluster_info(0)['events'][-3:]}")
    out = {"turns": [{"prompt_tokens": w[1], "cached_tokens": w[2], "ttft_cached_s": w[0], "ttft_uncached_s": u[0],
                      "same_answer": w[3] == u[3]} for w, u in zip(runs["cached"], runs["uncached"], strict=True)]}
    for n, turn in enumerate(out["turns"]):
        print(f"  tensor mode, turn {n + 1}: {turn['prompt_tokens']} prompt tokens, {turn['cached_tokens']} cached: "
              f"TTFT {turn['ttft_cached_s']:.2f} s cached, {turn['ttft_uncached_s']:.2f} s without "
              f"(x{turn['ttft_uncached_s'] / turn['ttft_cached_s']:.1f}; same answer: {turn['same_answer']})")
    return out


def main() -> dict:
    results: dict = {}
    with LocalCluster(3) as warm, \
            LocalCluster(3, extra_args=["--prefix-cache-bytes", "0"]) as cold:
        with_cache, without = chat(warm.api_urls[0]), chat(cold.api_urls[0])
        only_new, _, _ = ttft(cold.api_urls[0], [{"role": "user", "content": TURN.format(n=TURNS)}])
        for n, (w, c) in enumerate(zip(with_cache, without, strict=True)):
            print(f"  turn {n + 1:2d}: {w[1]:5d} prompt tokens, {w[2]:5d} cached: TTFT {w[0]:6.2f} s cached, "
                  f"{c[0]:6.2f} s without (x{c[0] / w[0]:.1f})")
        results["turns"] = [{"prompt_tokens": w[1], "cached_tokens": w[2], "ttft_cached_s": w[0],
                             "ttft_uncached_s": c[0]} for w, c in zip(with_cache, without, strict=True)]
        results["turn10_speedup"] = without[-1][0] / with_cache[-1][0]
        results["turn10_vs_new_tokens_only"] = with_cache[-1][0] / only_new
        print(f"  turn 10: x{results['turn10_speedup']:.1f} faster with the cache (goal >= 10); "
              f"{results['turn10_vs_new_tokens_only']:.2f}x the TTFT of its new tokens alone "
              f"({only_new:.2f} s; goal <= 1.3)")
        per_stage = []
        for i in range(3):
            info = httpx.get(f"{warm.api_urls[i]}/v1/cluster", timeout=10).json()["prefix_cache"]
            layers = info["layer_range"][1] - info["layer_range"][0]
            if info["tokens"]:
                measured = info["bytes"] / info["tokens"]
                per_stage.append({"stage": i, "bytes_per_token": measured,
                                  "model_kv_bytes_per_token": layers * KV_BYTES_PER_TOKEN_PER_LAYER})
                print(f"  stage {i}: {measured:,.0f} bytes per cached token; the model's KV for its {layers} "
                      f"layers: {layers * KV_BYTES_PER_TOKEN_PER_LAYER:,} (x{measured / (layers * 1536):.3f})")
        results["memory"] = per_stage
        a, b = concurrent_ttft(warm.api_urls[0]), concurrent_ttft(cold.api_urls[0])
        results["concurrent_8_shared_4000"] = {"mean_ttft_cached_s": a, "mean_ttft_uncached_s": b, "speedup": b / a}
        print(f"  8 concurrent on a shared ~4,000-token prefix: mean TTFT {a:.2f} s cached, {b:.2f} s without "
              f"(x{b / a:.1f})")
        results["disk_tier"] = disk_tier(cold.api_urls[0])
    results["tensor_mode"] = tensor_mode()
    Path(__file__).with_name("results_prefix.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
