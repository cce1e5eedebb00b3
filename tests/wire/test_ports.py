"""Ports for child processes come from outside the kernel's ephemeral range, so that no
client connection on the machine can take one before the child binds it.

Expected values: the range as the kernel states it (``/proc/sys/net/ipv4/
ip_local_port_range``, read here directly) and, where it cannot be read, the IANA
dynamic range 49152-65535 (RFC 6335, section 6).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ringlet.daemon.wire import ports

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


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
