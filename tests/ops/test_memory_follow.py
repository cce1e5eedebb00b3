"""The memory a node offers (probe, cgroup, ``--memory-limit``) and the follower that
re-advertises it and asks for a re-plan when a limit changes (no daemon: fakes for the
node, the membership and the negotiator)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from ringlet.daemon.ops.memory_follow import MemoryFollower, offered_memory
from ringlet.daemon.probes.memory import MemoryInfo

GB = 1_000_000_000
HOST = MemoryInfo(total_bytes=25 * GB, available_bytes=20 * GB, usable_memory_bytes=20 * GB,
                  usable_rule="80% of total", usable_source="80% of total RAM (23.3 GiB): 18.6 GiB")
CGROUP = replace(HOST, usable_memory_bytes=2 * GB, usable_rule="cgroup v1 memory.limit_in_bytes",
                 usable_source="cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory/a): 80% of 2.4 GiB: 1.9 GiB",
                 cgroup_limit_bytes=2_600_000_000, cgroup_others_bytes=0, runtime_bytes=80_000_000)


class FakeNode:
    """What the follower uses of a Node: its config, boundary budget (a sixteenth of the
    usable memory, as Node.boundary_budget) and event log."""

    def __init__(self, usable):
        self.config = SimpleNamespace(usable_memory_bytes=usable)
        self.engine = SimpleNamespace(boundaries=SimpleNamespace(budget_bytes=0))
        self.events = []

    def boundary_budget(self):
        return (self.config.usable_memory_bytes or 0) // 16

    def event(self, kind, message):
        self.events.append((kind, message))


class FakeMembership:
    def __init__(self):
        self.own_record = {"name": "a"}

    def set_record(self, record):
        self.own_record = record


class FakeNegotiator:
    def __init__(self):
        self.changes = 0

    def membership_changed(self):
        self.changes += 1


def follower(memory, flag=None):
    node = FakeNode(offered_memory(memory, flag)[0] if memory.usable_rule.startswith("cgroup") else flag)
    f = MemoryFollower(node, memory, flag)
    f.membership, f.negotiator = FakeMembership(), FakeNegotiator()
    return f


def test_offered_memory_lowest_wins():
    assert offered_memory(HOST, None) == (20 * GB, HOST.usable_source)
    assert offered_memory(CGROUP, 3 * GB) == (2 * GB, CGROUP.usable_source)
    assert offered_memory(CGROUP, GB) == (GB, "--memory-limit: 954 MiB")


def test_record_fields_keep_the_boundary_budget_off():
    f = follower(CGROUP)
    assert f.fields() == {"memory_total_bytes": 25 * GB, "usable_memory_bytes": 2 * GB - 125_000_000,
                          "usable_memory_source": CGROUP.usable_source + "; 119 MiB of it kept for boundary "
                                                                         "activations",
                          "boundary_cache_bytes": 125_000_000}


def test_a_lowered_limit_is_advertised_and_replanned():
    f = follower(CGROUP)
    assert not f.update(replace(CGROUP, usable_memory_bytes=2 * GB - 50_000_000))  # 2.5 %: not worth a plan
    assert f.negotiator.changes == 0 and f.membership.own_record == {"name": "a"}
    lower = replace(CGROUP, usable_memory_bytes=GB, cgroup_limit_bytes=1_350_000_000,
                    usable_source="cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory/a): 80% of 1.3 GiB: 954 MiB")
    assert f.update(lower)
    assert f.negotiator.changes == 1
    assert f.node.config.usable_memory_bytes == GB  # the node's stores follow the limit
    assert f.node.engine.boundaries.budget_bytes == GB // 16
    assert f.membership.own_record["usable_memory_bytes"] == GB - GB // 16
    assert f.membership.own_record["usable_memory_source"].startswith(lower.usable_source)
    assert f.membership.own_record["name"] == "a"
    assert f.node.events == [("memory", "usable memory 1.9 GiB -> 954 MiB: " + f.membership.own_record[
        "usable_memory_source"])]
    assert not f.update(lower)  # the same again: nothing


def test_a_new_limit_of_the_same_size_still_counts_and_the_flag_caps():
    f = follower(CGROUP, flag=GB)
    assert f.node.config.usable_memory_bytes == GB
    moved = replace(CGROUP, cgroup_limit_bytes=2_700_000_000)  # another limit, figure within 5 %
    assert f.update(moved)
    assert f.node.config.usable_memory_bytes == GB  # --memory-limit stays the cap
    assert f.membership.own_record["usable_memory_source"].startswith("--memory-limit: 954 MiB")


def test_a_peers_usable_memory_change_replans():
    f = follower(HOST)
    member = SimpleNamespace(node_id="b", record={"usable_memory_bytes": 5 * GB, "links": {}})
    f.record_changed(member)  # first sight: plan with it
    assert f.negotiator.changes == 1
    member.record = {"usable_memory_bytes": 5 * GB, "links": {"a": 1}}  # another field: no re-plan
    f.record_changed(member)
    assert f.negotiator.changes == 1
    member.record = {"usable_memory_bytes": 3 * GB, "links": {"a": 1}}
    f.record_changed(member)
    assert f.negotiator.changes == 2


def test_a_lanes_share_is_followed_and_never_offered_past_the_given_memory_limit(tmp_path):
    """A model's lane (ops/lanes.py) offers the lower of its share and --memory-limit as
    given: a share that grows past the flag stops at the flag (8 GB given, shares 5 then 12 GB:
    offers 5 GB, then 8 GB)."""
    share = tmp_path / "share"
    share.write_text(str(5 * GB))
    node = FakeNode(8 * GB)
    f = MemoryFollower(node, HOST, 8 * GB, share_file=str(share))
    f.membership, f.negotiator = FakeMembership(), FakeNegotiator()
    assert f.offered_bytes() == 5 * GB
    assert f.fields()["usable_memory_source"].startswith("what the node's higher-priority models leave: 4.7 GiB")
    share.write_text(str(12 * GB))
    assert f.follow_share() and f.offered_bytes() == 8 * GB and f.negotiator.changes == 1
    assert f.fields()["usable_memory_source"].startswith("--memory-limit: 7.5 GiB")
    share.write_text(str(int(7.9 * GB)))  # under the flag by less than 5 %: kept, not re-advertised
    assert not f.follow_share() and f.negotiator.changes == 1
