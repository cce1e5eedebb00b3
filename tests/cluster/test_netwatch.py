"""This node's own addresses (issue 42, must-have 7), pure: why there is none, which one is
advertised, and what a reading reports as changed. The interfaces are written here
(psutil's readings replaced); the daemons themselves: tests/cluster/test_boot_netns.py."""

from __future__ import annotations

import asyncio
import socket
from collections import namedtuple

import psutil
import pytest

from ringlet.daemon.cluster.addresses import advertised_host, no_address_reason
from ringlet.daemon.cluster.netwatch import AddressWatcher, NetworkFollower, hosts

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
Stats = namedtuple("Stats", "isup duplex speed mtu flags")

LO = {"lo": ([Addr(socket.AF_INET, "127.0.0.1", None, None, None)], Stats(True, 0, 0, 65536, "up,loopback,running"))}
UP = "up,broadcast,running,multicast"


def net(**interfaces) -> dict:
    """``name=(ipv4 addresses, flags)`` each, with ``lo``: ``{name: (addrs, stats)}``."""
    out = dict(LO)
    for name, (ips, flags) in interfaces.items():
        out[name] = ([Addr(socket.AF_INET, ip, None, None, None) for ip in ips],
                     Stats("running" in flags, 2, 1000, 1500, flags))
    return out


@pytest.fixture
def machine(monkeypatch):
    """The interfaces psutil reports: assign ``machine.now = net(...)``."""
    class Machine:
        now = net()

    m = Machine()
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {k: v[0] for k, v in m.now.items()})
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {k: v[1] for k, v in m.now.items()})
    return m


def test_why_there_is_no_address_names_each_interface():
    states = net(eth0=([], "broadcast,multicast"), eth1=([], "up,broadcast,multicast"), eth2=([], UP),
                 docker0=(["172.17.0.1"], UP))
    addrs, stats = {k: v[0] for k, v in states.items()}, {k: v[1] for k, v in states.items()}
    assert no_address_reason(None, if_addrs=addrs, if_stats=stats) == (
        "no non-loopback IPv4 address on any interface that is up (eth0: down; eth1: up, no carrier yet; "
        "eth2: no IPv4 address; docker0: skipped (a Docker bridge))")
    assert no_address_reason(["eth9", "eth2"], if_addrs=addrs, if_stats=stats) == (
        "no non-loopback IPv4 address on the interfaces given (--interface) (eth9: no such interface; "
        "eth2: no IPv4 address)")
    assert no_address_reason(None, if_addrs={"lo": []}, if_stats={k: v[1] for k, v in LO.items()}).endswith(
        "(none but loopback)")


def test_the_advertised_address_stays_while_it_is_there(machine):
    machine.now = net(eth0=(["10.0.0.5"], UP), eth1=(["10.1.0.5"], UP))
    assert advertised_host(None, "0.0.0.0", None) == "10.0.0.5"  # noqa: S104 - a wildcard --host
    assert advertised_host(None, "0.0.0.0", None, prefer="10.1.0.5") == "10.1.0.5"  # noqa: S104
    assert advertised_host(None, "0.0.0.0", None, prefer="10.9.9.9") == "10.0.0.5"  # noqa: S104 - gone
    assert advertised_host("192.0.2.1", "0.0.0.0", None) == "192.0.2.1"  # noqa: S104
    assert advertised_host(None, "10.0.0.5", None) == "10.0.0.5"
    machine.now = net(eth0=([], "broadcast,multicast"))
    assert advertised_host(None, "0.0.0.0", None) is None  # noqa: S104 - none yet: the daemon waits


def test_readings_report_an_address_appearing_changing_and_vanishing(machine):
    machine.now = net(eth0=(["10.0.0.5"], "up,broadcast,multicast"))  # up, no carrier yet
    watcher = AddressWatcher(None, "0.0.0.0", None, 7100)  # noqa: S104 - as a user starts it
    assert watcher.current.public is None and not watcher.static
    assert watcher.waiting.endswith("(eth0: up, no carrier yet)"), watcher.waiting
    assert watcher.poll() is None  # nothing changed
    machine.now = net(eth0=(["10.0.0.5"], UP))
    old, new = watcher.poll()
    assert (old.public, new.public, new.dial, new.mdns) == (None, "10.0.0.5", ("10.0.0.5:7100",), ("10.0.0.5",))
    assert watcher.waiting is None and watcher.info()["advertised"] == "10.0.0.5"
    machine.now = net(eth1=(["10.1.0.7"], UP), eth0=(["10.0.0.5"], UP))  # a second link, listed first
    old, new = watcher.poll()
    assert new.public == "10.0.0.5" and new.dial == ("10.0.0.5:7100", "10.1.0.7:7100")
    assert not hosts(old) - hosts(new)  # nothing went away: no connection to replace
    machine.now = net(eth1=(["10.1.0.7"], UP), eth0=(["10.0.0.9"], UP))  # renumbered
    old, new = watcher.poll()
    assert new.public == "10.1.0.7" and hosts(old) - hosts(new) == {"10.0.0.5"}
    machine.now = net(eth1=([], UP), eth0=([], "broadcast,multicast"))  # unplugged, asleep
    old, new = watcher.poll()
    assert new.public is None and new.dial == () and "eth0: down" in watcher.waiting
    assert watcher.info()["changes"] == 3


def test_only_literal_addresses_and_none_usable_is_refused_at_once(machine):
    machine.now = net(eth0=(["10.0.0.5"], UP))
    assert AddressWatcher(None, "0.0.0.0", ["127.0.0.1"], 7100).static  # noqa: S104 - nothing to wait for
    assert not AddressWatcher(None, "0.0.0.0", ["eth1"], 7100).static  # noqa: S104 - eth1 may come
    assert AddressWatcher(None, "0.0.0.0", ["10.0.0.5"], 7100).current.public == "10.0.0.5"  # noqa: S104


class FakeMembership:
    def __init__(self):
        self.address, self.members, self.considered = "10.0.0.5:7100", {}, []
        self._channels, self._retired = {"10.0.0.7:7100": "channel"}, []
        self.links_wanted = asyncio.Event()

    def consider(self, address, node_id=None):
        self.considered.append(address)


class FakeRouter:
    addresses: list[str] = []

    def publish(self):
        self.published = list(self.addresses)


def test_the_follower_moves_the_node_and_replaces_connections_only_when_an_address_went(machine):
    machine.now = net(eth0=(["10.0.0.5"], UP))
    watcher = AddressWatcher(None, "0.0.0.0", None, 7100)  # noqa: S104
    membership, router, reconnects, events = FakeMembership(), FakeRouter(), [], []

    async def reconnect():
        reconnects.append(1)

    follower = NetworkFollower(watcher, membership, router, reconnect=reconnect, peers=["10.0.0.9:7100"],
                               on_event=lambda kind, msg: events.append(msg))

    async def follow(**interfaces):
        machine.now = net(**interfaces)
        change = watcher.poll()
        if change is not None:
            await follower.changed(change[1])

    async def scenario():
        await follow(eth0=(["10.0.0.5"], UP), eth1=(["10.1.0.5"], UP))  # a cable plugged in
        assert router.published == ["10.0.0.5:7100", "10.1.0.5:7100"] and membership._channels and not reconnects
        await follow(eth0=([], "broadcast,multicast"), eth1=([], "broadcast,multicast"))  # asleep: none
        assert membership.address == "10.0.0.5:7100" and not reconnects  # the old ones stay advertised
        await follow(eth0=(["10.0.0.6"], UP))  # awake with another lease
        assert membership.address == "10.0.0.6:7100" and router.published == ["10.0.0.6:7100"]
        assert not membership._channels and membership._retired and reconnects == [1]  # connections replaced
        assert membership.considered[-1] == "10.0.0.9:7100" and membership.links_wanted.is_set()

    asyncio.run(scenario())
    assert [e.split(" (")[0].split(":")[0] for e in events] == ["addresses changed", "no network address any more",
                                                                "addresses changed"], events
    assert "10.0.0.5:7100, 10.1.0.5:7100 -> 10.0.0.6:7100" in events[-1]
