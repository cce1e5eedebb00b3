"""Several requests in flight across the ring at once (pipelined, one forward per
request; no batching yet): each greedy output is bit-identical to running it alone,
and a client that disconnects frees its KV caches on every stage."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from ringlet.daemon.demo import LocalCluster

PROMPTS = [
    ("Once upon a time", 12), ("The capital of France is", 6), ("def fibonacci(n):", 16),
    ("In 1969, the first humans", 9), ("Roses are red,", 14), ("The quick brown fox", 5),
    ("To make a good cup of tea,", 11), ("Machine learning is", 8),
]


@pytest.fixture(scope="module")
def pair():
    with LocalCluster(2, dtype="float32") as c:
        yield c


def complete(url: str, prompt: str, n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_eight_concurrent_requests_equal_their_solo_runs(pair):
    url = pair.api_urls[0]
    solo = [complete(url, p, n) for p, n in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda pn: complete(pair.api_urls[hash(pn[0]) % 2], *pn), PROMPTS))
    assert together == solo


def test_disconnect_frees_every_stage_cache(pair):
    url = pair.api_urls[1]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line and json.loads(line[6:])["choices"][0]["text"]:
                got += 1
                if got >= 3:
                    break  # the client goes away mid-stream
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not any(pair.cluster_info(i)["kv_caches"] for i in range(2)):
            return
        time.sleep(0.05)
    pytest.fail(f"KV caches left 2 s after the disconnect: {[pair.cluster_info(i)['kv_caches'] for i in range(2)]}")
