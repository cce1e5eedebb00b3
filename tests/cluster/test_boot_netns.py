"""A daemon that starts before its network, and one whose address changes under it
(issue 42, must-have 7): real daemons in network namespaces (``tests/netns.py``), started
as a user would on a LAN host (``--host 0.0.0.0 --api-host 0.0.0.0``, no ``--interface``),
each with one link, ``eth0``, a veth into the lab's bridge (as a container's is).

1. Node 1's ``eth0`` has no address and is down when it starts: it stays up and says it
   waits (state ``no-address``, ``/v1/cluster``'s ``network.waiting``, the log); once the
   address is added and the link set up, it is in a committed 2-stage plan with node 0
   within seconds, and the ring answers as the reference does.
2. Node 1's address is replaced (``ip addr del`` the old, ``ip addr add`` a new one): it
   advertises the new one, node 0 dials it there without removing it, the plan moves to
   it, and the ring answers again.

Needs root and iproute2; skips with the reason otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import REFERENCE
from netns import GRPC_PORT, SUBNET, NetnsLab, cleanup_stale, in_namespace, sh, skip_reason, summarise
from streaming import Stream

_reason = skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(150)]

RAW = next(c for c in REFERENCE if "raw" in c)
ARGS = ["--mode", "pipeline", "--dtype", "float32"]
JOIN_S = 15.0  # address up -> in a committed 2-stage plan (measured: see the test's output)
FOLLOW_S = 15.0  # address replaced -> the plan names the new one
NEW_IP = f"{SUBNET}.12"
STREAMED = 80  # tokens of the request in flight while the address is replaced


@pytest.fixture(scope="module")
def lab() -> Iterator[NetnsLab]:
    if _reason is None:
        cleanup_stale()
    lab = NetnsLab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(autouse=True)
def _logs_on_failure(lab: NetnsLab) -> Iterator[None]:
    """The nodes' log tails, printed (pytest shows them for a failed test only)."""
    yield
    print(lab.dump_logs(40))


def local_view(d, timeout_s: float = 2.0) -> dict | str:
    """``/v1/cluster`` of daemon ``d`` over its namespace's loopback (it may have no other
    address), from a thread of our own inside that namespace; the error text otherwise."""
    def get():
        with in_namespace(d.ns), httpx.Client(trust_env=False) as client:
            return client.get("http://127.0.0.1:8000/v1/cluster", timeout=timeout_s).json()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(get).result()
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return repr(exc)


def complete(lab: NetnsLab, d, tokens: int = 12) -> list[int]:
    resp = lab.post(d, "/v1/completions", {"prompt": RAW["raw"], "max_tokens": tokens, "temperature": 0,
                                            "return_token_ids": True}, timeout=60)
    assert resp.status_code == 200, (d.index, resp.text)
    return resp.json()["choices"][0]["token_ids"]


def addresses(view: dict, node_id: str) -> tuple[str | None, list[str]]:
    """Where ``view``'s node dials ``node_id`` (or stands itself), and the plan's addresses of it."""
    member = next((m["grpc_address"] for m in view["members"] if m["node_id"] == node_id), None)
    return member, [s["address"] for s in view["plan"] if s["node_id"] == node_id]


def test_a_daemon_started_before_its_network_joins_once_an_address_appears(lab: NetnsLab):
    first, late = (lab.add_node(ARGS, wildcard=True, link_name="eth0") for _ in range(2))
    sh("ip", "-n", late.ns, "addr", "flush", "dev", "eth0")
    sh("ip", "-n", late.ns, "link", "set", "eth0", "down")
    lab.start(first)
    lab.start(late)
    deadline = time.monotonic() + 90
    lab.wait_healthy(first, deadline)
    while True:  # up, on loopback, saying it waits
        assert late.alive(), f"node 1 exited ({late.proc.returncode}) instead of waiting:\n{late.tail()}"
        view = local_view(late)
        if isinstance(view, dict) and view.get("state") == "no-address":
            break
        assert time.monotonic() < deadline, (view, late.tail())
        time.sleep(0.3)
    assert "eth0: down" in view["network"]["waiting"], view["network"]
    assert view["network"]["advertised"] is None and not view["plan"], view
    status = subprocess.run(["ip", "netns", "exec", late.ns, sys.executable, "-m", "ringlet.daemon.ops.cli",
                             "status", "--api", "http://127.0.0.1:8000"], capture_output=True, text=True, timeout=60)
    assert "waiting for a network address on " in status.stdout and "eth0: down" in status.stdout, status.stdout
    assert " no-address " in status.stdout, status.stdout  # its state
    assert late.alive() and local_view(late)["state"] == "no-address", late.tail()  # still, seconds later

    sh("ip", "-n", late.ns, "addr", "add", f"{late.ip}/24", "dev", "eth0")
    sh("ip", "-n", late.ns, "link", "set", "eth0", "up")
    up = time.monotonic()
    views = lab.wait_converged([first, late], stages=2, timeout_s=JOIN_S)
    joined = time.monotonic() - up
    ids = [views[d.index]["node_id"] for d in (first, late)]
    assert all(addresses(v, ids[1]) == (late.grpc_address, [late.grpc_address]) for v in views.values()), \
        summarise(views)
    answers = [complete(lab, d) for d in (first, late)]
    print(f"\naddress added and link up: in a committed 2-stage plan {joined:.1f} s later")
    assert answers[0] == answers[1] == RAW["completion_ids"][:12], answers
    log = late.log_path.read_text()
    assert "waiting for a network address: no non-loopback IPv4 address on any interface that is up (eth0: down" \
        in log, log[-3000:]


def test_an_address_replaced_under_a_running_member_is_followed(lab: NetnsLab):
    if not lab.daemons:  # run alone: two nodes started on links that are up
        nodes = [lab.add_node(ARGS, wildcard=True, link_name="eth0") for _ in range(2)]
        time.sleep(1.5)  # a link is "running" about a second after it is set up
        lab.start_nodes(nodes)
    first, moved = lab.daemons
    views = lab.wait_converged([first, moved], stages=2, timeout_s=30)
    ids = {d.index: views[d.index]["node_id"] for d in (first, moved)}
    old, new = moved.grpc_address, f"{NEW_IP}:{GRPC_PORT}"
    undisturbed = complete(lab, first, STREAMED)
    stream = Stream(first.api_url, RAW["raw"], STREAMED, timeout_s=90, context=lambda: in_namespace(lab.hub))
    stream.wait_tokens(5, timeout_s=30)
    wall = time.time()
    sh("ip", "-n", moved.ns, "addr", "del", f"{moved.ip}/24", "dev", "eth0")
    sh("ip", "-n", moved.ns, "addr", "add", f"{NEW_IP}/24", "dev", "eth0")
    t0 = time.monotonic()
    moved.ip = NEW_IP

    def followed(vs: dict) -> bool:
        return all(addresses(v, ids[moved.index]) == (new, [new]) for v in vs.values())

    views = lab.wait_converged([first, moved], stages=2, timeout_s=FOLLOW_S, min_epoch=views[0]["epoch"] + 1,
                               extra=followed)
    took = time.monotonic() - t0
    record = lab.node_records([moved])[moved.index]["record"]
    assert record["addresses"][0] == new and old not in record["addresses"], record["addresses"]
    assert views[moved.index]["network"]["advertised"] == NEW_IP, views[moved.index]["network"]
    # followed, not dropped and found again: node 0 never removed it
    left = [e for e in views[first.index]["events"] if e["kind"] == "leave" and e["ts"] >= wall]
    assert not left, left
    stream.join(60)
    print(f"\n{old} replaced by {new} mid-stream: the plan stands on it {took:.1f} s later (epoch "
          f"{views[0]['epoch']}); the stream's longest gap {stream.max_gap_s:.1f} s")
    assert stream.error is None and stream.ids == undisturbed, (stream.error, stream.ids, undisturbed)
    answers = [complete(lab, d) for d in (first, moved)]
    assert answers[0] == answers[1] == RAW["completion_ids"][:12], answers
    with contextlib.suppress(OSError):
        assert "addresses changed" in moved.log_path.read_text()
