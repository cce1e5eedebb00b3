"""Cluster benchmark (discovery, membership, negotiation), medians of 5:

* start -> every member lists the new node (discovery + handshake);
* kill -9 -> every survivor dropped it (heartbeats);
* join -> the new plan is serving (a request succeeds on it);
* kill -9 of a stage -> serving again on the survivors;
* bytes read from disk on a join, compared with a full reload of the same stages.

Daemons are real ``ringlet run`` processes on 127.0.0.1 with mDNS on loopback.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx

from ringlet.daemon.ops.demo import LocalCluster

ROUNDS = 5


def wait(predicate, timeout_s: float = 60.0, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(step_s)
    raise TimeoutError("condition not reached")


def served(url: str) -> bool:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0}, timeout=60)
    return r.status_code == 200


def main() -> dict:
    listed, dropped, join_serving, kill_serving, moved, full = [], [], [], [], [], []
    with LocalCluster(2, dynamic=True) as c:
        for _ in range(ROUNDS):
            before = c.cluster_info(0)
            t0 = time.monotonic()
            i = c.add_node(wait=False)
            new_id = wait(lambda i=i: c.cluster_info(i)["node_id"], step_s=0.01)
            wait(lambda new_id=new_id: all(new_id in {m["node_id"] for m in c.cluster_info(j)["members"]}
                                           for j in (0, 1)), step_s=0.01)
            listed.append(time.monotonic() - t0)
            plan = c.wait_plan(stages=3, timeout_s=60, min_epoch=before["epoch"] + 1)
            wait(lambda: served(c.api_urls[0]))
            join_serving.append(time.monotonic() - t0)
            infos = [c.cluster_info(j) for j in c.alive()]
            read = sum(_read_last(info) for info in infos)
            moved.append(read)
            full.append(sum(info["memory"]["weights_bytes"] for info in infos))
            victim = c.alive()[-1]
            t1 = time.monotonic()
            c.kill(victim)
            wait(lambda new_id=new_id: all(new_id not in {m["node_id"] for m in c.cluster_info(j)["members"]}
                                           for j in (0, 1)), step_s=0.01)
            dropped.append(time.monotonic() - t1)
            c.wait_plan(stages=2, timeout_s=60, nodes=[0, 1], min_epoch=plan["epoch"] + 1)
            wait(lambda: served(c.api_urls[0]))
            kill_serving.append(time.monotonic() - t1)
    out = {
        "bench": "cluster", "rounds": ROUNDS,
        "start_to_listed_s": statistics.median(listed),
        "kill_to_dropped_s": statistics.median(dropped),
        "join_to_serving_s": statistics.median(join_serving),
        "kill_to_serving_s": statistics.median(kill_serving),
        "join_bytes_read": statistics.median(moved),
        "join_full_reload_bytes": statistics.median(full),
    }
    out["join_bytes_ratio"] = out["join_bytes_read"] / out["join_full_reload_bytes"]
    for k, v in out.items():
        print(f"{k:<26} {v:.3f}" if isinstance(v, float) else f"{k:<26} {v}")
    Path(__file__).with_name("results_cluster.json").write_text(json.dumps(out, indent=1))
    return out


def _read_last(info: dict) -> int:
    """Bytes the node read at its last re-plan (from the event log, in MB)."""
    for event in reversed(info.get("events", [])):
        if event["kind"] == "replan" and "read" in event["message"]:
            return int(float(event["message"].rsplit("read ", 1)[1].split(" MB")[0]) * 1e6)
    return 0


if __name__ == "__main__":
    main()
