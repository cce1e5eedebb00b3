"""Ports for child processes come from outside the kernel's ephemeral range, so that no
client connection on the machine can take one before the child binds it.

Expected values: the range as the kernel states it (``/proc/sys/net/ipv4/
ip_local_port_range``, read here directly) and, where it cannot be read, the IANA
dynamic range 49152-65535 (RFC 6335, section 6).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringlet.daemon.wire import ports

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.fixture(autouse=True)
def own_registry(monkeypatch, tmp_path):
    """Each test holds ports in its own registry file (the machine's is shared by every
    test worker)."""
    monkeypatch.setattr(ports, "_REGISTRY", tmp_path / "ports.json")
    return tmp_path / "ports.json"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.skipif(not RANGE_FILE.exists(), reason="no Linux ephemeral range file here")
def test_ports_are_below_the_kernels_ephemeral_range_distinct_and_free():
    first, _ = (int(x) for x in RANGE_FILE.read_text().split())
    got = ports.free_ports(40)
    assert len(set(got)) == 40
    assert all(10000 <= p < first for p in got), got
    assert all(_bindable(p) for p in got)


def test_a_block_is_consecutive_free_ports():
    base = ports.free_port_block(5)
    assert all(_bindable(p) for p in range(base, base + 5))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    """With the pool narrowed to two ports, one of them held: only the other comes back."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        if not _bindable(taken + 1):
            pytest.skip(f"port {taken + 1} is in use here")
        monkeypatch.setattr(ports, "_candidates", lambda n: range(taken, taken + 2))
        monkeypatch.setattr(ports, "HOLD_S", 0.0)  # nothing held: each draw sees both ports again
        assert {ports.free_port_block(1) for _ in range(20)} == {taken + 1}


def test_without_the_kernels_range_the_iana_range_is_avoided(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == (49152, 65535)
    assert all(10000 <= p < 49152 for p in ports.free_ports(20))


def test_no_free_block_is_one_clear_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_candidates", lambda n: range(taken, taken + 1))
        with pytest.raises(OSError, match="no block of 1 free TCP ports on 127.0.0.1"):
            ports.free_port_block(1, tries=5)


def test_a_range_covering_every_port_falls_back_to_the_kernels_choice(monkeypatch, tmp_path):
    """With the ephemeral range at 1024-65535 nothing lies outside it: ports still come,
    free, from the kernel."""
    fake = tmp_path / "ip_local_port_range"
    fake.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", fake)
    assert not ports._candidates(1)
    got = ports.free_ports(5)
    assert len(set(got)) == 5 and all(_bindable(p) for p in got)
    base = ports.free_port_block(3)
    assert all(_bindable(p) for p in range(base, base + 3))


def _two_free_ports() -> int:
    """A base ``p`` with ``p`` and ``p + 1`` both bindable."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if _bindable(base + 1):
            return base
    pytest.skip("no two consecutive free ports here")


OTHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ringlet.daemon.wire import ports
    ports._REGISTRY = Path(sys.argv[1])
    base = int(sys.argv[2])
    ports._candidates = lambda n: range(base, base + 2)
    if sys.argv[3] == "draw":
        try:
            print(ports.free_port_block(1, tries=50), flush=True)
        except OSError as e:
            print("none", e, flush=True)
    else:
        print(ports.claim_port(int(sys.argv[3]), "127.0.0.1"), flush=True)
    if sys.argv[4] == "stay":
        sys.stdin.readline()
""")


def _other(registry: Path, base: int, what: str, stay: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", OTHER, str(registry), str(base), what, "stay" if stay else "go"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_port_handed_to_one_process_is_not_handed_to_another_while_it_lives(monkeypatch, own_registry):
    """Two processes drawing from one pool of two free ports (as two test workers, or a
    node's lanes beside a local cluster, draw from one range) get different ports though
    neither has bound its port yet; a third finds none; once the holder exits, its port is
    free to hand out again, and a port another live process holds cannot be claimed."""
    base = _two_free_ports()
    monkeypatch.setattr(ports, "_candidates", lambda n: range(base, base + 2))
    mine = ports.free_port_block(1)
    other = _other(own_registry, base, "draw", stay=True)
    try:
        theirs = int(other.stdout.readline())
        assert {mine, theirs} == {base, base + 1}
        with pytest.raises(OSError, match="no block of 1 free TCP ports"):
            ports.free_port_block(1, tries=50)
        third = _other(own_registry, base, "draw", stay=False)
        assert third.communicate(timeout=60)[0].startswith("none")
        assert not ports.claim_port(theirs, "127.0.0.1")  # held by a live process
        assert ports.claim_port(mine, "127.0.0.1")  # this process's own port, claimed again
    finally:
        other.communicate("\n", timeout=60)
    assert ports.free_port_block(1) == theirs  # its holder is gone
    claimer = _other(own_registry, base, str(mine), stay=False)
    assert claimer.communicate(timeout=60)[0].strip() == "False"  # still held here


def test_a_port_in_use_cannot_be_claimed(own_registry):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not ports.claim_port(port, "127.0.0.1")
    assert f'"{port}"' not in own_registry.read_text()  # nothing was held for it


def test_a_torn_registry_is_started_over(own_registry):
    own_registry.write_text("{not json")
    port = ports.free_port_block(1)
    assert _bindable(port) and str(port) in own_registry.read_text()
