"""Memory taken from a node after the plan (#43 must-have 3): another program joins b's memory
cgroup (as a build would, beside a daemon in the same container or service) and takes enough
that the cgroup holds 95 % of its limit. b sheds what it can rebuild (its prefix store
empties: an event says so and ``/v1/cluster`` shows the pressure), the ring re-plans with b
holding less, answers stay mlx-lm's whole model's, and nobody is OOM-killed. The program
ends: once the pressure has been gone for a while b turns its stores back on and takes its
layers back.

Sizes (the llama of tests/cgroups.py, 10 layers of 48 MiB): a's cgroup of 900 MB could hold
the whole model; b's of 450 MB offers ~190 MB (3 layers: 80 % of the limit less ~122 MiB of
runtime, a sixteenth for boundary activations and 29 MB of work space). With b's ~290 MB,
the program takes what brings the cgroup to ~95 % of its limit without page cache (~140 MB;
90 % is the pressure signal, probes/memory_pressure.py), still under it.
"""

from __future__ import annotations

import subprocess
import sys
import time

from cgroups import cgroup_ring

from tests.probes.test_cgroup_cluster import complete, token_ids

MB = 1_000_000
IDS = {"a": "a000000000000000", "b": "b000000000000000"}
LIMITS = {"a": 900_000_000, "b": 450_000_000}


#: The other program: it takes memory in 4 MiB steps until its cgroup's anonymous memory is
#: 95 % of the limit, and keeps it there (the daemon beside it may free some) until its
#: stdin closes. 95 %: over the 90 % signal, under the limit (no OOM kill).
HOG = """
import sys, threading, time
cg = sys.argv[1]
limit = int(open(cg + "/memory.limit_in_bytes").read())
def anon():
    return int(dict(line.split() for line in open(cg + "/memory.stat"))["total_rss"])
held, done = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while anon() < 0.95 * limit:
    held.append(b"x" * (4 << 20))
print("ready", flush=True)
while not done.wait(0.2):
    if anon() < 0.94 * limit:
        held.append(b"x" * (4 << 20))
"""


def b_layers(view: dict) -> int:
    return sum(s["end"] - s["start"] for s in view["plan_detail"]["stages"] if s["node_id"] == IDS["b"])


def wait_for(what, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"not seen within {timeout_s:.0f} s: {what}"
        time.sleep(0.5)
    return got


def test_a_program_that_takes_memory_sheds_the_stores_replans_and_gives_back(tmp_path, cgroup_llama):
    model, want = cgroup_llama
    with cgroup_ring(tmp_path / "run", model, LIMITS, IDS, ["--context", "256"]) as (c, cg):
        view = c.wait_plan(stages=2)
        held = b_layers(view)
        assert held == 3, view["plan_detail"]["stages"]
        assert token_ids(complete(c.api_urls[0])) == want
        b_info = lambda: c.cluster_info(1)  # noqa: E731
        assert b_info()["memory"]["prefix_cache_bytes"] > 0  # the request left its prefix at b
        assert b_info()["memory"]["pressure"] is None

        hog = subprocess.Popen(  # holds the cgroup's anonymous memory at 95 % of its limit until told to go
            ["sh", "-c", f'echo $$ > {cg["b"].path}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c",
             HOG, str(cg["b"].path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert hog.stdout.readline().strip() == "ready"
            pressure = wait_for("b's memory pressure", lambda: b_info()["memory"]["pressure"], 20)
            assert "of its limit without page cache" in pressure["reason"], pressure
            events = [e["message"] for e in b_info()["events"] if e["kind"] == "memory"]
            shed = [m for m in events if m.startswith("memory pressure: ")]
            assert shed and "shed" in shed[0] and "prefix store" in shed[0], events
            assert b_info()["memory"]["prefix_cache_bytes"] == 0
            smaller = wait_for("a plan with b holding less", lambda: (v := c.cluster_info(0))["epoch"] >
                               view["epoch"] and b_layers(v) < held and v, 30)
            assert token_ids(complete(c.api_urls[0])) == want
            assert cg["b"].oom_kills() == 0 and c.alive() == [0, 1]
        finally:
            hog.stdin.close()
            hog.wait(timeout=10)

        passed = wait_for("the pressure passing", lambda: any(
            e["message"].startswith("memory pressure passed") for e in b_info()["events"]), 45)
        assert passed and b_info()["memory"]["pressure"] is None
        back = wait_for("b's layers back", lambda: b_layers(v := c.cluster_info(0)) == held and v, 30)
        assert token_ids(complete(c.api_urls[1])) == want
        assert b_info()["memory"]["prefix_cache_bytes"] > 0  # the store is on again: the request left its prefix
        assert {k: g.oom_kills() for k, g in cg.items()} == {"a": 0, "b": 0}
        print(f"\npressure: {pressure['reason']}; b held {held} layers, {b_layers(smaller)} under pressure "
              f"(epoch {smaller['epoch']}), {b_layers(back)} after (epoch {back['epoch']}); events: "
              + " | ".join(e["message"] for e in b_info()["events"] if e["kind"] == "memory"))
