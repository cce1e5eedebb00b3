"""Link measurement in network namespaces: what ``tbf`` really lets through, and what
``daemon/linkprobe.measure`` reads, alone and when several members probe one node at
once (as every member does after a membership change).

4 namespaces on a bridge (``tests/netns.py``), node 3's veth pair shaped to 100 Mbit/s.
Needs root. Usage: ``.venv/bin/python bench/bench_netns.py``
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import NetnsLab, cleanup_stale, sh, skip_reason  # noqa: E402

TCP_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 9000)); s.listen(4)
print("ready", flush=True)
for _ in range(int(sys.argv[2])):
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"ok"); c.close()
"""

TCP_CLIENT = r"""
import socket, sys, time
size = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], 9000)); buf = b"\0" * size
t = time.perf_counter(); c.sendall(buf); c.shutdown(socket.SHUT_WR); c.recv(2)
print(size / (time.perf_counter() - t))
"""

ECHO_SERVER = r"""
import asyncio, sys
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb, ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.transport import TransportConfig, make_server

class Echo(pb_grpc.RingServicer):
    async def Echo(self, request, context):
        return pb.Ping(payload=request.payload if request.echo else b"", sent_at=request.sent_at)

async def main():
    server = make_server(TransportConfig(), sys.argv[1])
    pb_grpc.add_RingServicer_to_server(Echo(), server)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""

PROBE = r"""
import asyncio, json, sys, time
from ringlet.daemon.cluster.linkprobe import measure
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.transport import TransportConfig, make_channel

async def main():
    channel = make_channel(TransportConfig(), sys.argv[1])
    stub = pb_grpc.RingStub(channel)
    from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
    await stub.Echo(pb.Ping(payload=b"", echo=True), timeout=10)  # connected before the common start
    delay = float(sys.argv[2]) - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    m = await measure(stub, "ethernet")
    print(json.dumps({"bw": m.bandwidth_bytes_per_s, "rtt": m.rtt_s}))
    await channel.close()

asyncio.run(main())
"""


def tcp(lab: NetnsLab, src: int, dst: int, size: int = 8 << 20, rounds: int = 2) -> float:
    """Best raw TCP throughput src -> dst, bytes/s."""
    a, b = lab.daemons[src], lab.daemons[dst]
    srv = subprocess.Popen(["ip", "netns", "exec", b.ns, sys.executable, "-c", TCP_SERVER, b.ip, str(rounds)],
                           stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        return max(float(sh("ip", "netns", "exec", a.ns, sys.executable, "-c", TCP_CLIENT, b.ip, str(size)).stdout)
                   for _ in range(rounds))
    finally:
        srv.wait(10)


def probes(lab: NetnsLab, pairs: list[tuple[int, int]]) -> list[dict]:
    """``linkprobe.measure`` for each (src, dst) pair, all starting at the same instant."""
    start = time.time() + 3.0  # after every client has imported and connected
    procs = [subprocess.Popen(["ip", "netns", "exec", lab.daemons[s].ns, sys.executable, "-c", PROBE,
                               lab.daemons[d].grpc_address, str(start)], stdout=subprocess.PIPE, text=True)
             for s, d in pairs]
    return [json.loads(p.communicate(timeout=60)[0]) for p in procs]


def main() -> int:
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    cleanup_stale()
    with NetnsLab() as lab:
        for _ in range(4):
            lab.add_node()
        lab.shape(3)
        print("raw TCP, 8 MiB, best of 2 (MB/s):")
        for s, d in ((0, 1), (1, 0), (0, 3), (3, 0)):
            print(f"  {s} -> {d}{' (shaped)' if 3 in (s, d) else ''}: {tcp(lab, s, d) / 1e6:8.1f}")
        servers = [subprocess.Popen(["ip", "netns", "exec", d.ns, sys.executable, "-c", ECHO_SERVER, d.grpc_address],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                   for d in lab.daemons]
        try:
            for s in servers:
                s.stdout.readline()
            print("linkprobe.measure (2 MiB Echo, best of 2), one probe at a time, 3 runs (MB/s; rtt ms):")
            for s, d in ((0, 1), (1, 0), (0, 3), (3, 0)):
                runs = [probes(lab, [(s, d)])[0] for _ in range(3)]
                bws = ", ".join(f"{r['bw'] / 1e6:.1f}" for r in runs)
                print(f"  {s} -> {d}{' (shaped)' if 3 in (s, d) else ''}: {bws}; "
                      f"rtt {statistics.median(r['rtt'] for r in runs) * 1e3:.2f}")
            print("linkprobe.measure, 3 members probing the shaped node 3 at the same instant (MB/s):")
            for r, pair in zip(probes(lab, [(0, 3), (1, 3), (2, 3)]), ((0, 3), (1, 3), (2, 3)), strict=True):
                print(f"  {pair[0]} -> {pair[1]}: {r['bw'] / 1e6:.1f}")
            print("linkprobe.measure, 3 members probing unshaped node 0 at the same instant (MB/s):")
            for r, pair in zip(probes(lab, [(1, 0), (2, 0), (3, 0)]), ((1, 0), (2, 0), (3, 0)), strict=True):
                print(f"  {pair[0]} -> {pair[1]}: {r['bw'] / 1e6:.1f}")
        finally:
            for s in servers:
                s.terminate()
            for s in servers:
                s.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
