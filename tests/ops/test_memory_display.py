"""Which rule set each node's usable memory (#43), as ``ringlet status`` and ``ringlet
doctor`` show it (pure: snapshots and /v1/cluster answers written here)."""

from __future__ import annotations

from ringlet.daemon.ops.doctor.machine import memory_verdict
from ringlet.daemon.ops.status.command import format_status
from ringlet.daemon.ops.status.snapshot import build_snapshot
from ringlet.daemon.probes.memory import MemoryInfo
from tests.ops.test_status import studio_infos

GIB = 1 << 30
CGROUP = ("cgroup v2 memory.max (/sys/fs/cgroup/system.slice/ringlet.service): 80% of 64.0 GiB less 210 MiB "
          "the daemon's runtime: 51.0 GiB; 1.0 GiB of it kept for boundary activations")


def test_status_names_the_rule_of_each_node():
    infos = studio_infos(2)
    members = infos["http://10.0.0.1:8000"]["members"]
    members[0].update(memory_usable_bytes=50 * GIB, memory_usable_source=CGROUP)
    members[1].update(memory_usable_source="80% of total RAM (512 GiB): 410 GiB")
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    assert [n["memory_usable_source"] for n in snap["nodes"]] == [CGROUP, "80% of total RAM (512 GiB): 410 GiB"]
    lines = format_status(snap).splitlines()
    assert f"memory of studio-1: 50.0 GiB for the planner · {CGROUP}" in lines
    assert "memory of studio-2: 480 GiB for the planner · 80% of total RAM (512 GiB): 410 GiB" in lines
    members[1].pop("memory_usable_source")  # a node of an older release: no line for it
    assert not any(x.startswith("memory of studio-2") for x in format_status(
        build_snapshot("http://10.0.0.1:8000", infos, {})).splitlines())


MEM = MemoryInfo(total_bytes=256 * GIB, available_bytes=200 * GIB, usable_memory_bytes=int(204.8 * GIB),
                 usable_rule="80% of total", usable_source="80% of total RAM (256 GiB): 205 GiB")


def test_doctor_says_the_rule_here_and_the_running_daemons():
    alone = memory_verdict(MEM, None, None)
    assert alone.summary == ("total 256 GiB, usable 205 GiB (80% of total RAM (256 GiB): 205 GiB), "
                             "available now 200 GiB")
    cluster = {"members": [{"node_id": "b", "state": "alive", "memory_usable_bytes": 1},
                           {"node_id": "a", "state": "self", "memory_usable_bytes": 50 * GIB,
                            "memory_usable_source": CGROUP}]}
    check = memory_verdict(MEM, None, cluster)
    assert check.summary == alone.summary + f"; the running daemon offers the planner 50.0 GiB ({CGROUP})"
    assert check.details["daemon_usable_source"] == CGROUP
    assert memory_verdict(MEM, None, "could not read /v1/cluster: timeout").summary == alone.summary
    big = memory_verdict(MEM, 400 * GIB, cluster)
    assert big.summary.endswith("the model (400 GiB) needs about 2 nodes like this one (the cluster splits it)")


def test_status_says_which_node_is_under_memory_pressure():
    infos = studio_infos(2)
    url = "http://10.0.0.1:8000"
    reason = "tasks stalled on memory 14% of the last 10 s (/proc/pressure/memory)"
    infos[url]["memory"] = {"pressure": {"reason": reason, "for_s": 9.6, "shed_bytes": 3 * GIB, "cuts": 1,
                                         "offered_bytes": 40 * GIB}}
    lines = format_status(build_snapshot(url, infos, {})).splitlines()
    assert ("memory pressure on studio-1 for 10 s: tasks stalled on memory 14% of the last 10 s "
            "(/proc/pressure/memory) · shed 3.0 GiB · offering 40.0 GiB") in lines
    assert not any(x.startswith("memory pressure on studio-2") for x in lines)
