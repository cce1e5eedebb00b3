"""Spine benchmark: decode tokens/s and TTFT of 1 process vs 2 and 3 local daemons.

Every configuration is measured in the same run, through the same HTTP API
(``ringlet run`` processes on 127.0.0.1 with a static even plan), so the ratios
compare like with like. Also reported: the latency each hop adds, two ways —
(decode time per token with N stages - with 1) / N hops per token, and the
median one-way hop time the daemons record from message timestamps — and the
round trip of a small gRPC call for scale.

Run: ``make bench`` (all benchmarks) or ``python bench/bench_spine.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx

from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

PROMPT = "Once upon a time"
TOKENS = 48
RUNS = 3


def stream_times(url: str, prompt: str, max_tokens: int, times: list[float] | None = None,
                 on_token: Callable[[int], None] | None = None) -> list[float]:
    """One greedy streamed completion: appends each token's arrival time
    (``time.perf_counter()``) to ``times`` and calls ``on_token(n)`` after the n-th.

    Raises:
        RuntimeError: the stream carried an error event.
    """
    times = [] if times is None else times
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(payload["error"].get("message", payload["error"]))
                ids = payload["choices"][0].get("token_ids") or []
                times.extend([time.perf_counter()] * len(ids))
                if ids and on_token is not None:
                    on_token(len(times))
    return times


def stream_once(url: str, max_tokens: int) -> tuple[float, float, int]:
    """One greedy streamed completion: (TTFT s, decode tokens/s, tokens)."""
    t0 = time.perf_counter()
    times = stream_times(url, PROMPT, max_tokens)
    ttft = times[0] - t0
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return ttft, decode, len(times)


def grpc_rtt_us(port: int, n: int = 40) -> float:  # under the control-RPC rate limit
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.RingStub(ch)
        stub.Echo(pb.Ping(echo=True))
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Echo(pb.Ping(payload=b"x" * 64, echo=True))
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def measure(nodes: int) -> dict:
    with LocalCluster(nodes) as c:
        url = c.api_urls[0]
        stream_once(url, 8)  # warm-up
        runs = [stream_once(url, TOKENS) for _ in range(RUNS)]
        hops = [httpx.get(f"{u}/v1/cluster").json()["hop_latency_median_s"] for u in c.api_urls]
        rtt = grpc_rtt_us(c.grpc_ports[0])
    return {
        "nodes": nodes,
        "ttft_s": statistics.median(r[0] for r in runs),
        "decode_tokens_per_s": statistics.median(r[1] for r in runs),
        "hop_one_way_median_us": [h * 1e6 if h is not None else None for h in hops],
        "grpc_echo_rtt_us": rtt,
    }


def main() -> dict:
    results = [measure(n) for n in (1, 2, 3)]
    base = results[0]
    for r in results:
        r["tokens_per_s_ratio"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["ttft_ratio"] = r["ttft_s"] / base["ttft_s"]
        if r["nodes"] > 1:
            per_token = 1 / r["decode_tokens_per_s"] - 1 / base["decode_tokens_per_s"]
            r["added_per_hop_us"] = per_token / r["nodes"] * 1e6  # N hops per token around the ring
    print(f"{'setup':<12}{'tokens/s':>10}{'ratio':>8}{'TTFT ms':>10}{'ratio':>8}{'+us/hop':>10}{'hop 1-way us':>16}")
    for r in results:
        hop = [f"{h:.0f}" for h in r["hop_one_way_median_us"] if h is not None]
        print(f"{r['nodes']} process{'es' if r['nodes'] > 1 else '  '} {r['decode_tokens_per_s']:>10.2f}"
              f"{r['tokens_per_s_ratio']:>8.3f}{r['ttft_s'] * 1e3:>10.1f}{r['ttft_ratio']:>8.3f}"
              f"{r.get('added_per_hop_us', 0):>10.0f}{','.join(hop) or '-':>16}")
    print(f"gRPC Echo round trip (median): {base['grpc_echo_rtt_us']:.0f} us")
    out = {"bench": "spine", "tokens": TOKENS, "runs": RUNS, "results": results}
    Path(__file__).with_name("results_spine.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
