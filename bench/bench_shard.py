"""Shard-transfer benchmark: peer-to-peer shard transfer over loopback gRPC vs a plain TCP socket.

The source is the default model's GGUF (about 98 MB); the transfer is the shard of
every layer (header + all tensors: every byte of the file but alignment padding, if
any), so all methods move exactly the same bytes. A server process (this file with
``--serve``) answers both the gRPC ``ShardManifest``/``FetchShard`` calls (the real
``serve_manifest``/``serve_fetch`` behind ``transport.make_server``) and a plain TCP
socket that sends the same byte ranges (``os.pread`` + ``sendall``, 4 MiB at a time).
The client, in this process, runs each method in turn, RUNS rounds:

* ``grpc``: :func:`ringlet.daemon.shards.transfer.fetch_shard_detailed` of layers
  [0, 30) into an empty cache directory — the whole call: manifest calls, the stream,
  writing the sparse file, sha256 of every tensor, the state file, the fdatasyncs;
* ``grpc_stream_to_memory``: the bare ``FetchShard`` stream of the same ranges into
  memory (no verification, no file): the transport alone;
* ``socket_to_memory``: the same bytes over one TCP connection into a reused buffer;
* ``socket_to_file``: the same, written with ``pwrite`` into a sparse file at the
  same offsets, then fsync (the end result of ``grpc`` without verification).

``ratio`` (goal >= 0.4) is the median over rounds of grpc / socket_to_memory measured
back to back (paired, so load that changes between rounds cancels out); medians,
bests, the other ratios and the CPU seconds per GB (client + server processes) are
reported too. The first gRPC fetch, while the source's digest cache is cold (it hashes
every tensor and chunk once), is reported separately and not in the medians.

Usage: ``.venv/bin/python bench/bench_shard.py`` (writes ``bench/results_shard.json``;
``main() -> dict`` for bench/run.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results_shard.json"
RUNS = 7
PIECE = 4 * 1024 * 1024


def _ranges(path: Path) -> list[tuple[int, int]]:
    """``(offset, length)`` of the header and every tensor, touching ones merged: the bytes
    a fetch of every layer asks for."""
    from ringlet.daemon.shards.layout import gguf_layout
    from ringlet.daemon.shards.local import merge_spans

    return [(a, b - a) for a, b in merge_spans((r.offset, r.end) for r in gguf_layout(path).regions)]


# --- server process ---------------------------------------------------------------------

def _raw_server(sock: socket.socket, path: Path) -> None:
    """Plain TCP: read an 8-byte length + JSON list of [offset, length], send those bytes."""
    fd = os.open(path, os.O_RDONLY)
    while True:
        conn, _ = sock.accept()
        with conn:
            (n,) = struct.unpack("<Q", conn.recv(8, socket.MSG_WAITALL))
            ranges = json.loads(conn.recv(n, socket.MSG_WAITALL))
            for offset, length in ranges:
                done = 0
                while done < length:
                    k = min(PIECE, length - done)
                    conn.sendall(os.pread(fd, k, offset + done))
                    done += k


async def _serve(digest_dir: str) -> None:
    import grpc  # noqa: F401

    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.shards import serve as shard_serve
    from ringlet.daemon.shards.digests import DigestCache
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
    from ringlet.daemon.wire.transport import TransportConfig, make_server

    location = resolve(None)
    digests = DigestCache(Path(digest_dir))

    class Servicer(pb_grpc.RingServicer):
        async def ShardManifest(self, request, context):  # noqa: N802
            return await shard_serve.serve_manifest(request, context, location, digests=digests)

        async def FetchShard(self, request, context):  # noqa: N802
            async for chunk in shard_serve.serve_fetch(request, context, location, digests=digests):
                yield chunk

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = make_server(TransportConfig(), f"127.0.0.1:{port}")
    pb_grpc.add_RingServicer_to_server(Servicer(), server)
    await server.start()
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(4)
    threading.Thread(target=_raw_server, args=(raw, location.path), daemon=True).start()
    print(json.dumps({"grpc": port, "raw": raw.getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(0)


# --- client -------------------------------------------------------------------------------

def _socket_fetch(port: int, ranges: list[tuple[int, int]], out: Path | None) -> tuple[int, float]:
    t0 = time.perf_counter()
    total = sum(n for _, n in ranges)
    buf = bytearray(PIECE)
    view = memoryview(buf)
    fd = None
    if out is not None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.truncate(out, max(o + n for o, n in ranges))
    with socket.create_connection(("127.0.0.1", port)) as s:
        body = json.dumps(ranges).encode()
        s.sendall(struct.pack("<Q", len(body)) + body)
        for offset, length in ranges:
            done = 0
            while done < length:
                k = s.recv_into(view[: min(PIECE, length - done)])
                if not k:
                    raise ConnectionError("server closed early")
                if fd is not None:
                    os.pwrite(fd, view[:k], offset + done)
                done += k
    if fd is not None:
        os.fsync(fd)
        os.close(fd)
    return total, time.perf_counter() - t0


async def _grpc_fetch(port: int, cache: Path) -> dict:
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.shards.transfer import fetch_shard_detailed
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
    from ringlet.daemon.wire.transport import TransportConfig, make_channel

    channel = make_channel(TransportConfig(), f"127.0.0.1:{port}")
    try:
        r = await fetch_shard_detailed(pb_grpc.RingStub(channel), resolve(None).name, (0, 30), cache, progress=False)
    finally:
        await channel.close()
    return {"bytes": r.bytes_fetched, "seconds": r.seconds, "needed": r.bytes_needed}


async def _grpc_stream(port: int, ranges: list[tuple[int, int]]) -> tuple[int, float]:
    """The bare FetchShard stream into memory (no verification, no file): the transport alone."""
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
    from ringlet.daemon.wire.transport import TransportConfig, make_channel

    location = resolve(None)
    channel = make_channel(TransportConfig(), f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.RingStub(channel)
        t0 = time.perf_counter()
        n = 0
        request = pb.ShardRequest(model=location.name, file=location.path.name,
                                  ranges=[pb.ByteRange(offset=a, length=b) for a, b in ranges])
        async for chunk in stub.FetchShard(request):
            n += len(chunk.data)
        return n, time.perf_counter() - t0
    finally:
        await channel.close()


class _Cpu:
    """CPU seconds (user + system, all threads) used by this process and the server."""

    def __init__(self, server_pid: int):
        import psutil

        self._me, self._server = psutil.Process(), psutil.Process(server_pid)

    def read(self) -> tuple[float, float]:
        a, b = self._me.cpu_times(), self._server.cpu_times()
        return a.user + a.system, b.user + b.system


def main() -> dict:
    """Run the comparison, print a summary, write bench/results_shard.json, return the results."""
    from ringlet.daemon.engine.sources import resolve

    path = resolve(None).path
    ranges = _ranges(path)
    total = sum(n for _, n in ranges)
    methods = ("grpc", "grpc_stream_to_memory", "socket_to_memory", "socket_to_file")
    speed: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}  # client + server CPU seconds per GB
    paired: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-shard-") as tmp:
        tmp = Path(tmp)
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(tmp / "digests")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            ports = json.loads(proc.stdout.readline())
            meter = _Cpu(proc.pid)
            cold = asyncio.run(_grpc_fetch(ports["grpc"], tmp / "cold"))
            shutil.rmtree(tmp / "cold")
            for i in range(RUNS):
                for method in methods:
                    c0 = meter.read()
                    if method == "grpc":
                        g = asyncio.run(_grpc_fetch(ports["grpc"], tmp / f"grpc{i}"))
                        n, dt = g["bytes"], g["seconds"]
                        shutil.rmtree(tmp / f"grpc{i}")  # like raw{i}.bin: free the page cache for the next run
                    elif method == "grpc_stream_to_memory":
                        n, dt = asyncio.run(_grpc_stream(ports["grpc"], ranges))
                    elif method == "socket_to_memory":
                        n, dt = _socket_fetch(ports["raw"], ranges, None)
                    else:
                        n, dt = _socket_fetch(ports["raw"], ranges, tmp / f"raw{i}.bin")
                        (tmp / f"raw{i}.bin").unlink()
                    c1 = meter.read()
                    assert n == total, (method, n, total)
                    speed[method].append(n / dt)
                    cpu[method].append((c1[0] - c0[0] + c1[1] - c0[1]) / (n / 1e9))
                paired.append(speed["grpc"][-1] / speed["socket_to_memory"][-1])
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    med = {m: statistics.median(v) for m, v in speed.items()}
    results = {
        "bytes": total,
        "runs": RUNS,
        "ratio": statistics.median(paired),
        "goal_ratio": 0.4,
        "ratio_of_medians": med["grpc"] / med["socket_to_memory"],
        "ratio_of_best": max(speed["grpc"]) / max(speed["socket_to_memory"]),
        "ratio_vs_socket_to_file": med["grpc"] / med["socket_to_file"],
        "ratio_stream_to_memory_vs_socket_to_memory": med["grpc_stream_to_memory"] / med["socket_to_memory"],
        "median_bytes_per_s": med,
        "best_bytes_per_s": {m: max(v) for m, v in speed.items()},
        "cpu_seconds_per_gb_client_plus_server": {m: statistics.median(v) for m, v in cpu.items()},
        "grpc_cold_source_bytes_per_s": cold["bytes"] / cold["seconds"],
        "samples_bytes_per_s": speed,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    gb = 1e9
    print(f"shard transfer of {total / 1e6:.1f} MB over loopback, {RUNS} interleaved runs (median; best):")
    for m in methods:
        print(f"  {m:24s} {med[m] / gb:5.2f} GB/s; best {max(speed[m]) / gb:5.2f} GB/s; "
              f"{results['cpu_seconds_per_gb_client_plus_server'][m]:.2f} CPU s/GB")
    print(f"  first fetch (source hashing): {results['grpc_cold_source_bytes_per_s'] / gb:.2f} GB/s")
    print(f"  ratio gRPC shard transfer / plain socket: {results['ratio']:.2f} (median of paired runs; goal >= 0.4); "
          f"best/best {results['ratio_of_best']:.2f}; vs socket to a file {results['ratio_vs_socket_to_file']:.2f}")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        asyncio.run(_serve(sys.argv[2]))
    else:
        main()
