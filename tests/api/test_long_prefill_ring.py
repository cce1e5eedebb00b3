"""A client that leaves mid-prefill on a two-stage ring (issue #35, points 3 and 4): it
talks to stage 1's API, which streams from stage 0 over gRPC; the prompt progress stage 0
reports reaches it through that stream; once it disconnects, stage 0 stops between two
chunks and both stages drop the request's KV cache within about a chunk's time. Slowed as
in test_long_prefill.py."""

from __future__ import annotations

import json
import time

import httpx
from test_long_prefill import CHUNK, DELAY_S, MODEL, messages, sse_lines

from ringlet.daemon.node.config import TEST_CHUNK_DELAY_ENV
from ringlet.daemon.ops.demo import LocalCluster


def test_disconnect_mid_prefill_releases_on_every_stage():
    env = {"RINGLET_KEEPALIVE_S": "1", TEST_CHUNK_DELAY_ENV: str(DELAY_S)}
    with LocalCluster(2, dtype="float32", extra_args=["--prefill-chunk", str(CHUNK)], env=env) as cluster:
        infos = {u: httpx.get(u + "/v1/cluster", timeout=5).json() for u in cluster.api_urls}
        (head,) = [u for u, i in infos.items() if i["stage"] == 0]
        (other,) = [u for u in infos if u != head]
        seen: dict[str, list] = {"progress": []}

        def leave(line: str) -> bool:  # after three chunks: the prefill is under way on both stages
            if '"prompt_progress"' in line:
                seen["progress"].append(json.loads(line[6:])["prompt_progress"])
            if not seen["progress"] or seen["progress"][-1]["processed"] < 3 * CHUNK:
                return False
            seen["kv"] = [httpx.get(u + "/v1/cluster", timeout=5).json()["kv_caches"] for u in (head, other)]
            seen["prefilling"] = httpx.get(head + "/v1/cluster", timeout=5).json()["prefilling"]
            return True

        body = {"model": MODEL, "messages": messages(6), "max_tokens": 3, "stream": True,
                "stream_options": {"include_progress": True}}
        sse_lines(other, "/v1/chat/completions", body, until=leave)
        left = time.monotonic()
        done = [p["processed"] for p in seen["progress"]]  # stage 0's chunks, relayed by stage 1's node
        assert done == sorted(set(done)) and done[0] <= 2 * CHUNK and done[-1] % CHUNK == 0
        assert len({p["total"] for p in seen["progress"]}) == 1 and done[-1] < seen["progress"][0]["total"]
        assert all(len(kv) == 1 for kv in seen["kv"])  # the request held KV on both stages
        (entry,) = seen["prefilling"]
        assert CHUNK <= entry["processed_tokens"] < entry["prompt_tokens"]
        while any(httpx.get(u + "/v1/cluster", timeout=5).json()["kv_caches"] for u in (head, other)):
            assert time.monotonic() - left < 2 * DELAY_S + 1.5  # about one chunk
            time.sleep(0.1)
        last = httpx.get(head + "/v1/cluster", timeout=5).json()["recent_requests"][-1]
        assert last["completion_tokens"] == 0 and last["ttft_s"] is None
