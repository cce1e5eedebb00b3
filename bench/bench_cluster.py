"""Cluster benchmark (discovery, membership, negotiation), medians of 5:

* start -> every member lists the new node (discovery + handshake);
* kill -9 -> every survivor dropped it (heartbeats);
* join -> the new plan is serving (a request succeeds on it);
* kill -9 of a stage -> serving again on the survivors;
* bytes read from disk on a join, compared with a full reload of the same stages;
* heal (issue 36): a member killed -9, kept down :data:`DOWN_S` (its peers keep dialling
  it), restarted with its data dir and ports -> it is in every member's committed plan;
  idle, and under load (a core burnt beside the daemons, :data:`CLIENTS` clients streaming
  through node 0); median and max of :data:`HEAL_ROUNDS`, from the restart and from the
  moment its API first answers (the daemon's own start excluded). Its baseline: the same
  figures idle, and the bench run on the previous commit.

Daemons are real ``ringlet run`` processes on 127.0.0.1 with mDNS on loopback.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from ringlet.daemon.ops.demo import LocalCluster

ROUNDS = 5
HEAL_ROUNDS = 5
#: seconds a killed member stays down before its restart (the soak of issue 36: ~50 s)
DOWN_S = 10.0
#: clients streaming through node 0 while the heal is measured under load
CLIENTS = 2


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
    out.update(heal())
    for k, v in out.items():
        print(f"{k:<26} {v:.3f}" if isinstance(v, float) else f"{k:<26} {v}")
    Path(__file__).with_name("results_cluster.json").write_text(json.dumps(out, indent=1))
    return out


def _ids(c: LocalCluster, j: int) -> set[str]:
    return {m["node_id"] for m in c.cluster_info(j)["members"]}


def _healed(c: LocalCluster, ids: set[str]) -> bool:
    """Every node lists exactly ``ids`` and all committed one plan over all of them."""
    views = [c.cluster_info(j) for j in range(c.n)]
    return (all({m["node_id"] for m in v["members"]} == ids for v in views)
            and len({(v["epoch"], v.get("plan_id")) for v in views}) == 1
            and {s["node_id"] for s in views[0].get("plan") or []} == ids)


@contextlib.contextmanager
def _load(url: str) -> Iterator[None]:
    """A process burning one core, and :data:`CLIENTS` threads streaming completions through ``url``."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    with http.stream("POST", f"{url}/v1/completions", json={
                            "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}) as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                break

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        burner.kill()
        burner.wait()
        for t in threads:
            t.join(timeout=130)


def heal() -> dict:
    """Restart -> in every member's committed plan, idle and loaded, seconds (median, max)."""
    out: dict = {}
    with LocalCluster(3, dynamic=True) as c:
        c.wait_plan(stages=3, timeout_s=120)
        ids = {c.cluster_info(j)["node_id"] for j in range(3)}
        victim = 2
        gone = c.cluster_info(victim)["node_id"]
        for label in ("idle", "loaded"):
            times, after_up = [], []
            with _load(c.api_urls[0]) if label == "loaded" else contextlib.nullcontext():
                for _ in range(HEAL_ROUNDS):
                    c.kill(victim)
                    wait(lambda: all(gone not in _ids(c, j) for j in (0, 1)), timeout_s=60, step_s=0.05)
                    time.sleep(DOWN_S)
                    c.restart(victim, wait=False)
                    t0 = time.monotonic()
                    up = wait(lambda: c.cluster_info(victim) and time.monotonic(), timeout_s=300, step_s=0.05)
                    wait(lambda: _healed(c, ids), timeout_s=300, step_s=0.05)
                    times.append(time.monotonic() - t0)
                    after_up.append(t0 + times[-1] - up)
                    print(f"  heal {label}: {times[-1]:.2f} s ({after_up[-1]:.2f} s after its API answered)")
            out[f"heal_{label}_median_s"] = statistics.median(times)
            out[f"heal_{label}_max_s"] = max(times)
            out[f"heal_{label}_after_up_median_s"] = statistics.median(after_up)
            out[f"heal_{label}_after_up_max_s"] = max(after_up)
    out["heal_down_s"] = DOWN_S
    return out


def _read_last(info: dict) -> int:
    """Bytes the node read at its last re-plan (from the event log, in MB)."""
    for event in reversed(info.get("events", [])):
        if event["kind"] == "replan" and "read" in event["message"]:
            return int(float(event["message"].rsplit("read ", 1)[1].split(" MB")[0]) * 1e6)
    return 0


if __name__ == "__main__":
    main()
