"""Memory pressure (#43 must-have 3): the kernel's signals read from files in their
documented formats (Documentation/accounting/psi.rst; cgroup-v2.rst ``memory.events``), the
reason they give, and a node's steps under pressure — shed the stores, offer less while it
stays, turn back once it passed — with real prefix and boundary stores and a clock the
test moves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ringlet.daemon.engine.boundary import BoundaryStore
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.ops import memory_pressure
from ringlet.daemon.ops.memory_follow import MemoryFollower
from ringlet.daemon.probes.common import ProbeParseError
from ringlet.daemon.probes.memory_pressure import (
    PressureReading,
    parse_macos_pressure_level,
    parse_memory_events,
    parse_psi,
    pressure_reason,
    read_pressure,
)
from tests.ops.test_memory_follow import CGROUP, FakeMembership, FakeNegotiator

MIB = 1 << 20
PSI = "some avg10=12.50 avg60=3.10 avg300=0.80 total=4242\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=99\n"


def test_psi_and_events_parse_in_their_documented_formats():
    assert parse_psi(PSI) == {"some_avg10": 12.5, "some_avg60": 3.1, "some_avg300": 0.8,
                              "full_avg10": 1.0, "full_avg60": 0.0, "full_avg300": 0.0}
    assert parse_memory_events("low 0\nhigh 17\nmax 2\noom 0\noom_kill 0\n") == {
        "low": 0, "high": 17, "max": 2, "oom": 0, "oom_kill": 0}
    assert parse_macos_pressure_level("kern.memorystatus_vm_pressure_level: 2") == 2
    assert parse_macos_pressure_level("1\n") == 1
    for bad in ("some avg10=x", "", "pressure!"):
        with pytest.raises(ProbeParseError):
            parse_psi(bad)
    with pytest.raises(ProbeParseError):
        parse_memory_events("high")


def test_the_reasons_in_order():
    calm = PressureReading(psi_some_avg10=0.5, psi_source="/proc/pressure/memory", used_bytes=500 * MIB,
                           limit_bytes=1000 * MIB, available_bytes=10 << 30, total_bytes=16 << 30)
    assert pressure_reason(calm, None) is None
    stalled = PressureReading(**{**calm.__dict__, "psi_some_avg10": 12.5})
    assert pressure_reason(stalled, calm) == "tasks stalled on memory 12% of the last 10 s (/proc/pressure/memory)"
    near = PressureReading(**{**calm.__dict__, "used_bytes": 900 * MIB})  # 90 % of the limit
    assert pressure_reason(near, calm) == ("the cgroup holds 90% of its limit without page cache "
                                           "(900 of 1000 MiB)")
    events = PressureReading(**{**calm.__dict__, "events": {"high": 3, "max": 0}})
    assert pressure_reason(events, None) is None  # counters are read against the poll before
    assert pressure_reason(PressureReading(**{**calm.__dict__, "events": {"high": 5, "max": 0}}), events) == \
        "the cgroup's memory.events high grew by 2"
    host = PressureReading(available_bytes=500 * MIB, total_bytes=16 << 30)  # under 5 % of 16 GiB, no cgroup
    assert pressure_reason(host, None) == "the machine has 500 MiB available of 16.0 GiB"
    assert pressure_reason(PressureReading(macos_level=1), None) is None
    assert pressure_reason(PressureReading(macos_level=4), None) == (
        "macOS memory pressure level 4 (kern.memorystatus_vm_pressure_level)")


def test_a_v2_cgroups_own_pressure_file_is_read_before_the_machines(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/pressure").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/system.slice/ringlet.service\n")
    (tmp_path / "proc/self/mountinfo").write_text(
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
    own = tmp_path / "sys/fs/cgroup/system.slice/ringlet.service"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("1073741824\n")
    (own / "memory.current").write_text("104857600\n")
    (own / "memory.stat").write_text("anon 104857600\nfile 0\nshmem 0\n")
    (own / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 0\noom_kill 0\n")
    (own / "memory.pressure").write_text(PSI)
    (tmp_path / "proc/pressure/memory").write_text(PSI.replace("12.50", "0.00"))
    got = read_pressure(tmp_path, platform="linux")
    assert (got.psi_some_avg10, got.psi_source) == (12.5, "/sys/fs/cgroup/system.slice/ringlet.service/memory.pressure")
    assert got.events["max"] == 4 and (got.used_bytes, got.limit_bytes) == (100 * MIB, 1 << 30)
    (own / "memory.pressure").unlink()  # a kernel without per-cgroup PSI: the machine's
    got = read_pressure(tmp_path, platform="linux")
    assert (got.psi_some_avg10, got.psi_source) == (0.0, "/proc/pressure/memory")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Engine:
    """A node's engine as the responder uses it: real stores, ``run`` on the caller's thread."""

    def __init__(self):
        self.prefix = PrefixStore(0)
        self.boundaries = BoundaryStore(0)
        self.stage = SimpleNamespace(nbytes=lambda: 800 * MIB)

    async def run(self, fn, *args):
        return fn(*args)


class Node:
    def __init__(self):
        self.config = SimpleNamespace(usable_memory_bytes=2_000_000_000)
        self.engine = Engine()
        self.events = []
        self.stores_off = False

    def boundary_budget(self):
        return 100 * MIB

    def prefix_budget(self, stage):
        return 0 if self.stores_off else 300 * MIB

    def planned_stage_bytes(self, weights):
        return weights + 40 * MIB

    def event(self, kind, message):
        self.events.append(message)


def test_shed_then_offer_less_while_it_stays_then_turn_back(monkeypatch):
    monkeypatch.setattr(memory_pressure, "_clear_mlx_cache", lambda: 3 * MIB)
    node, clock, readings = Node(), Clock(), []
    f = MemoryFollower(node, CGROUP, None, pressure_read=lambda: readings[-1])
    f.membership, f.negotiator = FakeMembership(), FakeNegotiator()
    f.pressure.clock = clock
    node.engine.prefix.set_budget(300 * MIB)
    node.engine.boundaries.set_budget(100 * MIB)
    near = PressureReading(used_bytes=950 * MIB, limit_bytes=1000 * MIB)
    calm = PressureReading(used_bytes=500 * MIB, limit_bytes=1000 * MIB)

    async def poll(reading, after_s):
        readings.append(reading)
        clock.now += after_s
        await f.pressure.poll()

    async def scenario():
        await poll(calm, 2)
        assert f.pressure.info() is None and node.events == []
        await poll(near, 2)  # 1. shed at once
        assert node.stores_off and node.engine.prefix.budget_bytes == 0 and node.engine.boundaries.budget_bytes == 0
        assert node.events[-1] == ("memory pressure: the cgroup holds 95% of its limit without page cache (950 of "
                                   "1000 MiB); shed 3.0 MiB it can rebuild (prefix store 0 B, boundary store 0 B, "
                                   "MLX cache 3.0 MiB); the stores stay empty until it passes")
        assert f.negotiator.changes == 0 and f.cap_bytes is None
        await poll(near, 2)  # 2 s later: not yet
        assert f.cap_bytes is None
        await poll(near, 2)  # 4 s after shedding: offer a quarter less than the planned stage (840 MiB)
        assert f.cap_bytes == int(840 * MIB * 0.75) and f.negotiator.changes == 1
        assert f.membership.own_record["usable_memory_source"].startswith("memory pressure: 630 MiB (the rule: ")
        assert f.membership.own_record["usable_memory_bytes"] == int(840 * MIB * 0.75) - node.boundary_budget()
        assert node.events[-1].startswith("memory pressure stays: ") and "offering 630 MiB (was 1.9 GiB)" in \
            node.events[-1]
        assert f.pressure.info()["cuts"] == 1 and f.pressure.info()["offered_bytes"] == int(840 * MIB * 0.75)
        await poll(calm, 2)  # the first calm reading
        await poll(calm, 10)  # calm for 10 s: not yet
        assert node.stores_off
        await poll(calm, 6)  # calm for 16 s (15 needed): back
        assert not node.stores_off and f.cap_bytes is None and f.negotiator.changes == 2
        assert node.engine.prefix.budget_bytes == 300 * MIB and node.engine.boundaries.budget_bytes == 100 * MIB
        assert node.events[-1] == ("memory pressure passed after 22 s: the stores are back on; offering the rule's "
                                   "figure again")
        assert f.pressure.info() is None
        assert f.membership.own_record["usable_memory_source"].startswith(CGROUP.usable_source)

    asyncio.run(scenario())


def test_an_allocation_that_failed_anyway_sheds_and_offers_less_at_once(monkeypatch):
    """MLX on Metal raises ``[metal::malloc] Unable to allocate N bytes`` when an allocation
    fails (its CPU backend does not check, so this machine cannot fail one for real): the
    step ends as OutOfMemory, which the API node resumes, and the node sheds and cuts its
    offer without waiting for a signal."""
    from ringlet.daemon.engine.kv_room import KVRoom, OutOfMemory, allocation_failed

    heard = []
    room = KVRoom(100 * MIB, 1024.0, on_failed=heard.append)
    metal = RuntimeError("[metal::malloc] Unable to allocate 1073741824 bytes.")
    got = room.out_of_memory(metal)
    assert isinstance(got, OutOfMemory) and heard == ["[metal::malloc] Unable to allocate 1073741824 bytes."]
    assert "ran out of memory for the step" in str(got) and "offers the planner less" in str(got)
    other = ValueError("shapes do not match")
    assert room.out_of_memory(other) is other and len(heard) == 1
    assert allocation_failed(MemoryError()) and not allocation_failed(other)

    monkeypatch.setattr(memory_pressure, "_clear_mlx_cache", lambda: 0)
    node, clock = Node(), Clock()
    f = MemoryFollower(node, CGROUP, None, pressure_read=lambda: PressureReading())
    f.membership, f.negotiator = FakeMembership(), FakeNegotiator()
    f.pressure.clock = clock

    async def scenario():
        await f.pressure.allocation_failed(heard[0])
        assert node.stores_off and f.cap_bytes == int(840 * MIB * 0.75) and f.negotiator.changes == 1
        assert node.events[0].startswith("memory pressure: an allocation failed ([metal::malloc] Unable to allocate")
        assert node.events[1].startswith("memory pressure stays: an allocation failed")
        for _ in range(9):  # 18 s without a signal: turned back
            clock.now += 2
            await f.pressure.poll()
        assert not node.stores_off and f.cap_bytes is None

    asyncio.run(scenario())
