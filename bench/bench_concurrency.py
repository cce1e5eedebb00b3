"""Concurrency benchmark (issue #8): aggregate decode tokens/s at 1, 2, 4 and 8
concurrent requests on 2 and 3 local daemons, each as a ratio to 1 request in the
same run; mean TTFT per concurrency; batch figures the nodes publish.

The clusters negotiate their plans as ``ringlet run`` does (balanced policy: the
last stage, which also runs the 49152-word head, gets fewer layers). Every request
is a greedy streamed ``/v1/completions`` call on the default model
(SmolLM2-135M GGUF) to stage 0's API, with its own prompt (request 0's is the
spine's) and ``max_tokens`` = the spine's 48. The API has no ``ignore_eos``, so the
prompts are ones whose greedy continuation runs past 48 tokens, and the tokens
actually streamed (``return_token_ids``) are counted.

Definitions (one run of k concurrent requests, all sent at once; t_first,i / t_last,i
= arrival of request i's first / last token at the client, n_i = its tokens):

* aggregate decode tokens/s = sum_i (n_i - 1) / (max_i t_last,i - min_i t_first,i)
  — every token after each request's first, over the span from the earliest first
  token to the last token of all. For k = 1 it is bench_spine's decode tokens/s.
* TTFT = mean_i (t_first,i - t_send), t_send the common send time.
* per-point figure = median over the repeats (3 at k = 1, 2 at k = 2 and 4, 1 at k = 8;
  rounds interleave the concurrencies).

Also, in the same run: bench_spine's single-process measurement (``measure(1)``),
so the 1-request tokens/s of each cluster can be set against 1 process — the
spine's ratio, which issue #8 says must not move by more than 3 %.

Run: ``python bench/run.py bench_concurrency`` or ``python bench/bench_concurrency.py``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import bench_blas  # noqa: E402 - the bench directory is on the path only after the line above
import bench_spine  # noqa: E402

from ringlet.daemon.ops.demo import LocalCluster  # noqa: E402

STAGES = (2, 3)
CONCURRENCY = (1, 2, 4, 8)
TOKENS = bench_spine.TOKENS  # 48, as the spine, so k = 1 is the spine's measurement
# k = 1 as often as the spine (cheap, and the 3 % rule needs it); k = 8 once, to keep a run near 6 minutes
REPEATS = {1: bench_spine.RUNS, 2: 2, 4: 2, 8: 1}
# Greedy continuations of these all run to >= 64 tokens on SmolLM2-135M-Instruct (checked);
# the first is the spine's prompt.
PROMPTS = [
    bench_spine.PROMPT,
    "The history of the Roman Empire",
    "Here is a recipe for chocolate cake:",
    "In a distant galaxy,",
    "The best way to learn programming is",
    "Photosynthesis is the process",
    "Ten tips for a good night's sleep:",
    "The city of Paris",
]
# The node settings compared in one run (issue #15): ringlet's default (the optimized BLAS
# loaded by the node, `--dtype auto`: float32 on a CPU) and what it ran before that issue
# (MLX's bundled reference BLAS, the GGUF's own Q4 weights). The second runs on 2 stages only.
SETTINGS: dict[str, tuple[dict[str, str], str | None]] = {
    "default": ({}, None),
    "reference BLAS, Q4 (before #15)": bench_blas.BEFORE_ISSUE_15,
}
DEFINITION = ("aggregate decode tokens/s = sum over requests of (completion tokens - 1) / (last token of any "
              "request - earliest first token of any request), arrival times at the client; TTFT = mean over "
              "requests of (first token - common send time); each point the median of its repeats")


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, t_send: float,
                  first_event: asyncio.Event | None = None) -> dict:
    """One greedy streamed completion: token arrival times (one per token id)."""
    times: list[float] = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(f"generation failed: {payload['error']}")
                ids = payload["choices"][0].get("token_ids") or []
                if ids:
                    now = time.perf_counter()
                    if not times and first_event is not None:
                        first_event.set()
                    times.extend([now] * len(ids))
    if not times:
        raise RuntimeError(f"no tokens for prompt {prompt!r}")
    return {"ttft_s": times[0] - t_send, "first": times[0], "last": times[-1], "tokens": len(times)}


def _batch_figures(info: dict) -> dict:
    """Every entry of a ``/v1/cluster`` answer whose key mentions a batch (any depth), by dotted path,
    plus ``requests_in_flight``: whatever the node publishes about batching, tolerating absence."""
    found: dict = {}

    def walk(obj, path: str) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                p = f"{path}.{key}" if path else str(key)
                if "batch" in str(key).lower():
                    found[p] = value
                elif key not in ("events", "recent_requests"):
                    walk(value, p)

    walk(info, "")
    if "requests_in_flight" in info:
        found["requests_in_flight"] = info["requests_in_flight"]
    if isinstance(info.get("kv_caches"), list):
        found["kv_caches"] = len(info["kv_caches"])
    return found


async def _snapshot(client: httpx.AsyncClient, urls: list[str]) -> list[dict]:
    out = []
    for u in urls:
        try:
            out.append(_batch_figures((await client.get(f"{u}/v1/cluster", timeout=5)).json()))
        except (httpx.HTTPError, ValueError) as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


async def _run_point(urls: list[str], k: int, max_tokens: int = TOKENS, snapshot: bool = True) -> dict:
    """k concurrent requests to stage 0's API; aggregate figures and a batch snapshot taken
    once every request has its first token (all k in flight)."""
    limits = httpx.Limits(max_connections=2 * k + 4, max_keepalive_connections=2 * k + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        events = [asyncio.Event() for _ in range(k)]
        t_send = time.perf_counter()
        tasks = [asyncio.create_task(_stream(client, urls[0], PROMPTS[i], max_tokens, t_send, events[i]))
                 for i in range(k)]
        everything = asyncio.ensure_future(asyncio.gather(*tasks))
        live = None
        if snapshot and k > 1:
            all_first = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in events)))
            await asyncio.wait([all_first, everything], return_when=asyncio.FIRST_COMPLETED)
            if all_first.done() and not everything.done():
                live = await _snapshot(client, urls)
            all_first.cancel()
        reqs = await everything
    span = max(r["last"] for r in reqs) - min(r["first"] for r in reqs)
    decode_tokens = sum(r["tokens"] - 1 for r in reqs)
    per_request = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in reqs if r["last"] > r["first"]]
    return {
        "aggregate_tokens_per_s": decode_tokens / span if span > 0 else 0.0,
        "ttft_mean_s": statistics.mean(r["ttft_s"] for r in reqs),
        "per_request_tokens_per_s_mean": statistics.mean(per_request) if per_request else 0.0,
        "completion_tokens": [r["tokens"] for r in reqs],
        "span_s": span,
        "batch_live": live,
    }


def measure_cluster(stages: int, setting: str = "default") -> dict:
    """One cluster of ``stages`` negotiated daemons under one of ``SETTINGS``: every point's
    aggregate tokens/s, TTFT and batch figures, with each point's ratio to 1 request."""
    # negotiated plans, as `ringlet run` gives: the balanced planner puts fewer layers on
    # the stage with the head (an even split leaves the last stage the bottleneck)
    env, dtype = SETTINGS[setting]
    with LocalCluster(stages, dynamic=True, env=env, dtype=dtype) as c:
        c.wait_plan(stages)
        order = sorted(range(stages), key=lambda i: c.cluster_info(i)["stage"])
        urls = [c.api_urls[i] for i in order]  # stage 0's API first: requests go there
        asyncio.run(_run_point(urls, 1, 8, snapshot=False))  # warm-up, as the spine
        asyncio.run(_run_point(urls, max(CONCURRENCY), 4, snapshot=False))  # and every concurrent shape once
        runs: dict[int, list[dict]] = {k: [] for k in CONCURRENCY}
        after: dict[int, list[dict]] = {}
        for rnd in range(max(REPEATS.values())):
            for k in CONCURRENCY:
                if rnd < REPEATS[k]:
                    runs[k].append(asyncio.run(_run_point(urls, k)))
                    after[k] = asyncio.run(_snapshot_once(urls))
        plan = c.cluster_info(0)["plan"]
    points = []
    for k in CONCURRENCY:
        rs = runs[k]
        points.append({
            "concurrent": k,
            "aggregate_tokens_per_s": statistics.median(r["aggregate_tokens_per_s"] for r in rs),
            "ttft_mean_s": statistics.median(r["ttft_mean_s"] for r in rs),
            "per_request_tokens_per_s_mean": statistics.median(r["per_request_tokens_per_s_mean"] for r in rs),
            "aggregate_tokens_per_s_runs": [r["aggregate_tokens_per_s"] for r in rs],
            "completion_tokens": [r["completion_tokens"] for r in rs],
            "batch_live": [r["batch_live"] for r in rs],
            "batch_after": after[k],
        })
    one = points[0]["aggregate_tokens_per_s"]
    for p in points:
        p["ratio_to_1"] = p["aggregate_tokens_per_s"] / one
    return {"stages": stages, "setting": setting, "plan": [[s["start"], s["end"]] for s in plan], "points": points}


async def _snapshot_once(urls: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=5) as client:
        return await _snapshot(client, urls)


def _fmt_batch(snap: list[dict] | None) -> str:
    if not snap:
        return "-"
    parts = []
    for i, node in enumerate(snap):
        figures = {k: v for k, v in node.items() if k not in ("requests_in_flight", "kv_caches")}
        text = json.dumps(figures, separators=(",", ":"), default=str) if figures else "no batch figures"
        parts.append(f"stage {i}: in flight {node.get('requests_in_flight')}, KV caches {node.get('kv_caches')}, "
                     f"{text}")
    return "; ".join(parts)


def main() -> dict:
    t0 = time.perf_counter()
    single = bench_spine.measure(1)  # the spine's 1-process baseline, same run
    clusters = [measure_cluster(n) for n in STAGES]
    before = measure_cluster(2, "reference BLAS, Q4 (before #15)")
    spine_rows = [{"setup": "1 process", "tokens_per_s": single["decode_tokens_per_s"], "ratio": 1.0}]
    for cl in clusters:
        tps = cl["points"][0]["aggregate_tokens_per_s"]
        cl["single_request_ratio_to_1_process"] = tps / single["decode_tokens_per_s"]
        spine_rows.append({"setup": f"{cl['stages']} daemons, 1 request", "tokens_per_s": tps,
                           "ratio": cl["single_request_ratio_to_1_process"]})
    print(f"definition: {DEFINITION}")
    print(f"{TOKENS} greedy tokens per request, different prompts; repeats {REPEATS}")
    print(f"\n{'stages':>6}{'concurrent':>12}{'agg tok/s':>11}{'ratio':>8}{'TTFT ms':>10}{'per-req tok/s':>15}"
          "  setting")
    for cl in [*clusters, before]:
        for p in cl["points"]:
            print(f"{cl['stages']:>6}{p['concurrent']:>12}{p['aggregate_tokens_per_s']:>11.2f}{p['ratio_to_1']:>8.3f}"
                  f"{p['ttft_mean_s'] * 1e3:>10.0f}{p['per_request_tokens_per_s_mean']:>15.2f}  {cl['setting']}")
    print("\nsingle request vs 1 process (spine ratio):")
    for row in spine_rows:
        print(f"  {row['setup']:<24}{row['tokens_per_s']:>8.2f} tok/s{row['ratio']:>8.3f}")
    print("\nbatch figures from /v1/cluster (live: when all requests had their first token; after: once done):")
    for cl in clusters:
        for p in cl["points"]:
            live = next((s for s in p["batch_live"] if s), None)
            print(f"  {cl['stages']} stages, {p['concurrent']} concurrent: live {_fmt_batch(live)}")
        print(f"  {cl['stages']} stages, after the last point: {_fmt_batch(cl['points'][-1]['batch_after'])}")
    two = next(cl for cl in clusters if cl["stages"] == 2)
    at4 = next(p for p in two["points"] if p["concurrent"] == 4)["ratio_to_1"]
    at4_before = next(p for p in before["points"] if p["concurrent"] == 4)["ratio_to_1"]
    print(f"goal: >= 1.7x at 4 concurrent on 2 stages: {at4:.2f}x ({'met' if at4 >= 1.7 else 'not met'}); "
          f"{at4_before:.2f}x with the settings before issue #15")
    out = {"bench": "concurrency", "tokens": TOKENS, "repeats": REPEATS, "prompts": PROMPTS,
           "definition": DEFINITION, "single_process": single, "spine_ratio": spine_rows,
           "clusters": clusters, "before_issue_15": before,
           "goal_4_concurrent_2_stages": {"ratio": at4, "goal": 1.7, "met": at4 >= 1.7},
           "wall_s": time.perf_counter() - t0}
    Path(__file__).with_name("results_concurrency.json").write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
