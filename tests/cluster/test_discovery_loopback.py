"""Discovery with real zeroconf, restricted to loopback (127.0.0.1, IPv4 only).

Every test stops what it starts. Cluster names and node ids are random, so
other suites using mDNS on this machine at the same time cannot interfere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from ringlet.daemon.cluster import addresses as addr_mod
from ringlet.daemon.cluster.advert import SERVICE_TYPE, Advert, encode_txt
from ringlet.daemon.cluster.discovery import Discovery
from ringlet.daemon.cluster.identity import PROTOCOL_VERSION, NodeIdentity, cluster_id, new_node_id

LOOPBACK = ["127.0.0.1"]
#: How long a restarted child may take to be seen (or its goodbye heard): a bound for
#: "eventually", not a speed goal. A fresh-clone `make test` runs this beside the tensor
#: lane's rank processes on 2 cores, where 3 s once ran out.
SEEN_S = 10.0


def run(coro: Awaitable[Any], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond: Callable[[], bool], timeout: float) -> float:
    """Wait until cond() is true; return the seconds it took. Fails after timeout."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0


class Node:
    """A Discovery plus what its callbacks saw."""

    def __init__(self, cluster: str, port: int, secret: bytes | None = None, **kw: Any) -> None:
        self.peers: dict[str, Advert] = {}
        self.seen_at: dict[str, float] = {}
        self.goodbyes: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.disc = Discovery(
            kw.pop("node_id", new_node_id()),
            cluster,
            port,
            port + 1000,
            LOOPBACK,
            secret,
            on_peer=self._peer,
            on_goodbye=self._goodbye,
            **kw,
        )

    @property
    def id(self) -> str:
        return self.disc.node_id

    def _peer(self, advert: Advert) -> None:
        self.peers[advert.node_id] = advert
        self.seen_at.setdefault(advert.node_id, time.perf_counter())
        self.events.append(("peer", advert.node_id))

    def _goodbye(self, node_id: str) -> None:
        self.peers.pop(node_id, None)
        self.goodbyes.append(node_id)
        self.events.append(("goodbye", node_id))


def cluster() -> str:
    return f"test-{secrets.token_hex(4)}"


async def stop_all(*nodes: Node) -> None:
    for n in nodes:
        await n.disc.stop()


def test_three_nodes_see_each_other_then_goodbye() -> None:
    async def main() -> None:
        name = cluster()
        nodes = [Node(name, 41000 + i) for i in range(3)]
        try:
            t0 = time.perf_counter()
            for n in nodes:
                await n.disc.start()
            reg_ms = [n.disc.registration_s * 1000 for n in nodes]
            took = await until(lambda: all(len(n.peers) == 2 for n in nodes), 3.0)
            print(f"\nregistration {', '.join(f'{r:.2f}' for r in reg_ms)} ms; all 3 see 2 peers after {took:.3f} s")
            for n in nodes:
                assert set(n.peers) == {m.id for m in nodes} - {n.id}  # own advert ignored
                for m in nodes:
                    if m is not n:
                        a = n.peers[m.id]
                        assert a.addresses == ("127.0.0.1",)
                        assert (a.grpc_port, a.api_port) == (m.disc.advert.grpc_port, m.disc.advert.api_port)
                        assert a.cluster_id == cluster_id(name)
                        print(f"  {n.id} saw {m.id} {(n.seen_at[m.id] - t0) * 1000:.1f} ms after the first start")

            gone = nodes[2]
            t1 = time.perf_counter()
            await gone.disc.stop()
            stop_ms = (time.perf_counter() - t1) * 1000
            took = await until(lambda: all(gone.id in n.goodbyes for n in nodes[:2]), 2.0)
            print(f"stop() took {stop_ms:.0f} ms; goodbye seen {took * 1000:.1f} ms after it returned")
            for n in nodes[:2]:
                assert gone.id not in n.peers and n.goodbyes == [gone.id]
                assert n.disc.peers.keys() == {m.id for m in nodes[:2]} - {n.id}
        finally:
            await stop_all(*nodes)

    run(main())


def test_other_cluster_is_never_reported_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        name = cluster()
        a, b, stranger = Node(name, 41010), Node(name, 41011), Node(cluster(), 41012)
        try:
            with caplog.at_level(logging.WARNING, logger="ringlet.daemon.cluster.discovery"):
                for n in (a, b, stranger):
                    await n.disc.start()
                await until(lambda: b.id in a.peers and a.id in b.peers, 3.0)
                await a.disc.refresh(0.3)  # the stranger answers too, and is ignored again
                await asyncio.sleep(0.3)
            assert stranger.id not in a.peers and stranger.id not in b.peers
            assert not stranger.peers
            assert ("peer", stranger.id) not in a.events + b.events
            lines = [r.getMessage() for r in caplog.records if "other cluster" in r.getMessage()]
            inst = stranger.disc.advert.instance_name
            assert sum(inst in line for line in lines) == 2, lines  # once by a, once by b
        finally:
            await stop_all(a, b, stranger)

    run(main())


def test_wrong_secret_ignored_right_secret_seen(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        name = cluster()
        secret = secrets.token_bytes(32)
        a, b = Node(name, 41020, secret), Node(name, 41021, secret)
        wrong = Node(name, 41022, secrets.token_bytes(32))
        open_node = Node(name, 41023)  # no secret: unsigned advert
        try:
            with caplog.at_level(logging.WARNING, logger="ringlet.daemon.cluster.discovery"):
                for n in (a, b, wrong, open_node):
                    await n.disc.start()
                await until(lambda: b.id in a.peers and a.id in b.peers, 3.0)
                await asyncio.sleep(0.5)
            for n in (a, b):
                assert wrong.id not in n.peers and open_node.id not in n.peers
                assert n.peers[(b if n is a else a).id].signature is not None
            text = caplog.text
            assert "signature does not verify" in text and "unsigned advert" in text
            assert wrong.id not in a.disc.peers
        finally:
            await stop_all(a, b, wrong, open_node)

    run(main())


def test_signed_adverts_are_resigned_and_stay_valid() -> None:
    async def main() -> None:
        name = cluster()
        secret = secrets.token_bytes(16)
        a, b = Node(name, 41030, secret), Node(name, 41031, secret, resign_s=0.2)
        try:
            for n in (a, b):
                await n.disc.start()
            await until(lambda: b.id in a.peers, 3.0)
            first = a.disc.peers[b.id].signed_at
            await until(lambda: a.disc.peers[b.id].signed_at != first, 3.0)  # seconds resolution
            assert a.events.count(("peer", b.id)) == 1  # re-signing alone is not a new peer
        finally:
            await stop_all(a, b)

    run(main(), timeout=10)


def test_hostile_adverts_on_the_wire_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Malformed, huge, absurd-port and wrong-version adverts sent by a raw zeroconf responder."""

    async def main() -> None:
        name = cluster()
        cid = cluster_id(name)
        a = Node(name, 41040)
        raw = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
        good = Advert(new_node_id(), PROTOCOL_VERSION, 41041, 42041, cid, "0badc0de", 1)
        base = encode_txt(good, None)
        cases = {
            "absurd-port": {**base, b"g": b"99999"},
            "zero-port": {**base, b"a": b"0"},
            "version": {**base, b"v": b"7"},
            "missing": {k: v for k, v in base.items() if k != b"id"},
            "huge": {**base, **{f"k{i}".encode(): b"x" * 200 for i in range(30)}},
            "binary": {**base, b"id": b"\xff\x00\xfe"},
            "mismatch": base,  # instance name does not carry the TXT id
        }
        infos = []
        for i, (label, props) in enumerate(cases.items()):
            infos.append(
                AsyncServiceInfo(
                    SERVICE_TYPE,
                    f"evil-{label}.{SERVICE_TYPE}",
                    addresses=[socket.inet_aton("127.0.0.1")],
                    port=41100 + i,
                    properties=props,
                    server=f"evil-{label}.local.",
                )
            )
        try:
            with caplog.at_level(logging.INFO, logger="ringlet.daemon.cluster.discovery"):
                await a.disc.start()
                for info in infos:
                    await raw.async_register_service(info, cooperating_responders=True)
                await asyncio.sleep(0.6)
                for info in infos:  # re-announce: seen again, not logged again
                    await raw.async_update_service(info)
                await asyncio.sleep(0.4)
                await a.disc.refresh(0.3)
            assert a.peers == {} and a.events == []
            ignored = [r.getMessage() for r in caplog.records if "ignoring advert" in r.getMessage()]
            for label in cases:
                mine = [m for m in ignored if f"evil-{label}." in m]
                assert len(mine) == 1, (label, ignored)
            joined = "\n".join(ignored)
            assert "not in 1..65535" in joined and "incompatible protocol version 7" in joined
            assert "more than" in joined and "missing TXT field 'id'" in joined
            assert "instance name does not match" in joined
            # still working: a well-formed peer is seen after all that
            b = Node(name, 41050)
            await b.disc.start()
            try:
                await until(lambda: b.id in a.peers, 3.0)
            finally:
                await b.disc.stop()
        finally:
            await raw.async_close()
            await a.disc.stop()

    run(main())


def test_callback_errors_do_not_break_discovery(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        name = cluster()
        got: list[str] = []

        def bad(advert: Advert) -> None:
            raise RuntimeError("boom")

        async def good(advert: Advert) -> None:  # coroutine callbacks run as tasks
            got.append(advert.node_id)

        a = Discovery(new_node_id(), name, 41060, 42060, LOOPBACK, on_peer=bad)
        b = Discovery(new_node_id(), name, 41061, 42061, LOOPBACK, on_peer=good)
        c = Discovery(new_node_id(), name, 41062, 42062, LOOPBACK)
        try:
            with caplog.at_level(logging.ERROR, logger="ringlet.daemon.cluster.discovery"):
                for d in (a, b, c):
                    await d.start()
                await until(lambda: set(got) == {a.node_id, c.node_id}, 3.0)
                assert len(a.peers) == 2
            assert "callback failed" in caplog.text
        finally:
            for d in (a, b, c):
                await d.stop()

    run(main())


def test_refresh_reports_live_peers_again() -> None:
    async def main() -> None:
        name = cluster()
        a, b, c = Node(name, 41070), Node(name, 41071), Node(name, 41072)
        try:
            for n in (a, b, c):
                await n.disc.start()
            await until(lambda: len(a.peers) == 2, 3.0)
            before = len(a.events)
            t0 = time.perf_counter()
            answered = await a.disc.refresh()  # default timeout covers the 1 s rate limit
            print(f"\nrefresh answered by {len(answered)} peers in {time.perf_counter() - t0:.2f} s")
            assert {x.node_id for x in answered} == {b.id, c.id}
            assert sorted(a.events[before:]) == sorted([("peer", b.id), ("peer", c.id)])
        finally:
            await stop_all(a, b, c)

    run(main())


def test_address_change_is_reannounced(monkeypatch: pytest.MonkeyPatch) -> None:
    """interfaces=['lo'] (a name, so polled); a second loopback address appears."""
    import psutil

    real = psutil.net_if_addrs
    extra: list[Any] = []

    def fake_if_addrs() -> dict[str, list[Any]]:
        addrs = {name: list(v) for name, v in real().items() if name == "lo"}  # never anything but lo
        addrs["lo"] = [e for e in addrs["lo"] if e.family == socket.AF_INET] + extra
        return addrs

    monkeypatch.setattr(addr_mod.psutil, "net_if_addrs", fake_if_addrs)

    async def main() -> None:
        name = cluster()
        a = Node(name, 41080)
        b = Discovery(new_node_id(), name, 41081, 42081, ["lo"], address_poll_s=0.1)
        assert addr_mod.interface_addresses(["lo"]) == ["127.0.0.1"]
        try:
            await a.disc.start()
            await b.start()
            await until(lambda: b.node_id in a.peers, 3.0)
            assert a.peers[b.node_id].addresses == ("127.0.0.1",)
            extra.append(fake_if_addrs()["lo"][0]._replace(address="127.0.0.2"))
            took = await until(lambda: a.peers[b.node_id].addresses == ("127.0.0.1", "127.0.0.2"), 3.0)
            print(f"\naddress change seen by the peer {took * 1000:.0f} ms after it happened (poll 100 ms)")
            assert b.addresses == ["127.0.0.1", "127.0.0.2"]
            assert await b.update_addresses() is False  # no change since
        finally:
            await b.stop()
            await a.disc.stop()

    run(main())


def test_clone_newer_node_regenerates_and_both_stay_visible(tmp_path: Path) -> None:
    async def main() -> None:
        name = cluster()
        orig_id = NodeIdentity.load_or_create(tmp_path / "orig", now=1000.0)
        (tmp_path / "clone").mkdir()
        (tmp_path / "clone" / "node.json").write_bytes((tmp_path / "orig" / "node.json").read_bytes())
        clone_id = NodeIdentity.load_or_create(tmp_path / "clone", now=2000.0)
        assert clone_id.node_id == orig_id.node_id
        conflicts: dict[str, list[Advert]] = {"orig": [], "clone": []}
        done = asyncio.Event()

        def make(label: str, ident: NodeIdentity, port: int) -> Node:
            def on_conflict(other: Advert) -> Awaitable[None]:
                conflicts[label].append(other)

                async def fix() -> None:  # what the daemon does
                    new = ident.regenerate(f"node {other.addresses} uses the same id and started earlier")
                    await node.disc.set_node_id(new)
                    done.set()

                return fix()

            node = Node(
                name,
                port,
                node_id=ident.node_id,
                on_conflict=on_conflict,
                started_at_ms=ident.started_at_ms,
                incarnation=ident.incarnation,
            )
            return node

        orig, clone, observer = make("orig", orig_id, 41090), make("clone", clone_id, 41091), Node(name, 41092)
        try:
            for n in (observer, orig, clone):
                await n.disc.start()
            await asyncio.wait_for(done.wait(), 3.0)
            assert conflicts["orig"] == [] and [c.incarnation for c in conflicts["clone"]] == [orig_id.incarnation]
            assert clone_id.node_id != orig_id.node_id
            assert json.loads((tmp_path / "clone" / "node.json").read_text())["node_id"] == clone_id.node_id
            # the observer ends up with both, under distinct ids; the original keeps its id
            await until(
                lambda: (
                    set(observer.peers) == {orig_id.node_id, clone_id.node_id}
                    and observer.peers[orig_id.node_id].incarnation == orig_id.incarnation
                ),
                4.0,
            )
            assert orig_id.node_id not in observer.goodbyes  # the clone's goodbye did not drop the original
            assert clone_id.node_id in orig.peers and orig_id.node_id in clone.peers
        finally:
            await stop_all(observer, orig, clone)
            orig_id.close()
            clone_id.close()

    run(main())


CHILD = textwrap.dedent(
    """
    import asyncio, signal, sys
    from ringlet.daemon.cluster.identity import NodeIdentity
    from ringlet.daemon.cluster.discovery import Discovery

    async def main():
        ident = NodeIdentity.load_or_create(sys.argv[1])
        conflicts = []
        d = Discovery.for_identity(ident, sys.argv[2], int(sys.argv[3]), int(sys.argv[3]) + 1000,
                                   interfaces=["127.0.0.1"], on_conflict=conflicts.append)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await d.start()
        print(ident.node_id, ident.incarnation, flush=True)
        await asyncio.sleep(0.8)
        print("conflicts", len(conflicts), flush=True)
        try:
            await asyncio.wait_for(stop.wait(), 30)
        finally:
            await d.stop()
            ident.close()

    asyncio.run(main())
    """
)


def test_restart_after_kill9_keeps_id_and_leaves_no_ghost(tmp_path: Path) -> None:
    """kill -9 leaves stale records in peers' caches; the restart is not mistaken for a clone,
    and a later clean stop of the restarted node is a goodbye, not a resurrection of the ghost."""

    def spawn(name: str) -> tuple[subprocess.Popen[str], str, str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "data"), name, "41200"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        node_id, incarnation = proc.stdout.readline().split()
        return proc, node_id, incarnation

    async def main() -> None:
        name = cluster()
        observer = Node(name, 41201)
        procs: list[subprocess.Popen[str]] = []
        try:
            await observer.disc.start()
            p1, id1, inc1 = await asyncio.to_thread(spawn, name)
            procs.append(p1)
            await until(lambda: id1 in observer.peers, SEEN_S)
            p1.send_signal(signal.SIGKILL)  # no goodbye
            await asyncio.to_thread(p1.wait, 5)
            await asyncio.sleep(0.2)
            assert id1 in observer.peers and observer.goodbyes == []  # mDNS does not notice a crash

            p2, id2, inc2 = await asyncio.to_thread(spawn, name)
            procs.append(p2)
            assert id2 == id1 and inc2 != inc1  # same id from the data dir, new incarnation
            await until(lambda: observer.peers.get(id1) is not None and observer.peers[id1].incarnation == inc2, SEEN_S)
            assert p2.stdout is not None
            assert (await asyncio.to_thread(p2.stdout.readline)).split() == ["conflicts", "0"]
            assert list(observer.peers) == [id1]  # one entry, no duplicate

            p2.send_signal(signal.SIGTERM)  # clean stop: goodbye; the cached ghost must not come back
            assert await asyncio.to_thread(p2.wait, 5) == 0
            await until(lambda: id1 in observer.goodbyes, SEEN_S)
            await asyncio.sleep(0.2)
            assert id1 not in observer.peers
            assert observer.events.count(("peer", id1)) == 2  # first run, restart; not the ghost
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
            await observer.disc.stop()

    run(main(), timeout=4 * SEEN_S)
