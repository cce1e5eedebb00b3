"""Peer-to-peer shard transfer over real gRPC on 127.0.0.1, with the real default model.

A minimal Ring servicer (ShardManifest and FetchShard delegate to
``ringlet.daemon.shards.serve``) runs behind ``transport.make_server``; the client is
``fetch_shard`` over ``transport.make_channel``. The sparse copy must load a stage that
computes exactly what the original file does, hold far fewer disk blocks than its
apparent size, survive a corrupted chunk, resume after a kill, and be reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

from ringlet.daemon.engine.model_info import load_tokenizer
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.engine.stage import load_stage
from ringlet.daemon.errors import PlanError
from ringlet.daemon.ops.demo import free_ports
from ringlet.daemon.shards import serve as shard_serve
from ringlet.daemon.shards import transfer as shard_transfer
from ringlet.daemon.shards.digests import DigestCache
from ringlet.daemon.shards.fetch import FetchResult
from ringlet.daemon.shards.gguf_header import read_gguf_header
from ringlet.daemon.shards.layout import DEFAULT_CHUNK_BYTES, HEADER, STATE_SUFFIX, ShardError, gguf_layout
from ringlet.daemon.shards.local import LocalShard, safe_rel
from ringlet.daemon.shards.receiver import TransferProgress
from ringlet.daemon.shards.selection import gguf_stage_names
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.transport import TransportConfig, make_channel, make_server

MODEL = "smollm2-135m"


class Servicer(pb_grpc.RingServicer):
    """Serves shards of ``location``; test knobs: corrupt a chunk, break the stream after
    ``fail_after`` chunks (once), slow every chunk by ``delay_s``."""

    def __init__(self, location: ModelLocation, digests: DigestCache, corrupt=None, fail_after: int | None = None,
                 delay_s: float = 0.0):
        self.location, self.digests, self.corrupt = location, digests, corrupt
        self.fail_after, self.delay_s = fail_after, delay_s
        self.served = 0
        self.fetch_calls: list[pb.ShardRequest] = []

    async def ShardManifest(self, request, context):  # noqa: N802
        return await shard_serve.serve_manifest(request, context, self.location, digests=self.digests)

    async def FetchShard(self, request, context):  # noqa: N802
        self.fetch_calls.append(request)
        async for chunk in shard_serve.serve_fetch(request, context, self.location, digests=self.digests,
                                                   corrupt=self.corrupt):
            if self.fail_after is not None and self.served >= self.fail_after:
                self.fail_after = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, "test: the stream broke")
            self.served += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield chunk


@contextlib.asynccontextmanager
async def serving(servicer: Servicer):
    """A real gRPC server on 127.0.0.1 and a stub on a channel to it."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = make_server(TransportConfig(), address)
    pb_grpc.add_RingServicer_to_server(servicer, server)
    await server.start()
    channel = make_channel(TransportConfig(), address)
    try:
        yield pb_grpc.RingStub(channel), address
    finally:
        await channel.close()
        await server.stop(0)


def fetch(servicer: Servicer, layers: tuple[int, int], cache: Path, **kwargs) -> FetchResult:
    async def main():
        async with serving(servicer) as (stub, _):
            return await shard_transfer.fetch_shard_detailed(stub, MODEL, layers, cache, progress=False, **kwargs)

    return asyncio.run(main())


def region_bytes(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> DigestCache:
    return DigestCache(tmp_path_factory.mktemp("digests"))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shards")


def test_fetched_stage_computes_exactly_what_the_original_does(default_location, digests, shared_cache):
    result = fetch(Servicer(default_location, digests), (10, 20), shared_cache)
    sparse = result.location
    assert sparse.kind == "gguf" and sparse.name == MODEL
    assert sparse.path == shared_cache / MODEL / default_location.path.name
    # header + blocks 10..19 (9 tensors each), nothing more, nothing twice
    assert result.regions == 1 + 10 * 9
    assert result.bytes_fetched == result.bytes_needed and result.bytes_reused == 0 and result.chunks_resent == 0
    st = sparse.path.stat()
    assert st.st_size == default_location.path.stat().st_size
    assert st.st_blocks * 512 < 0.35 * st.st_size, "the copy should be sparse (header + 10 of 30 layers)"

    x = mx.random.normal((1, 4, 576), key=mx.random.key(7)).astype(mx.float32)
    outputs = []
    for location in (default_location, sparse):
        stage = load_stage(location, 10, 20, dtype="float32")
        y = stage(x, stage.make_cache())
        mx.eval(y)
        outputs.append(y)
    assert outputs[0].shape == (1, 4, 576)
    assert mx.array_equal(outputs[0], outputs[1]).item()

    tokenizer = load_tokenizer(sparse)  # metadata (tokenizer, chat template) comes with the header
    assert tokenizer.encode("Once upon a time") == [6403, 1980, 253, 655]


def test_another_range_extends_the_cache_and_a_warm_cache_fetches_nothing(default_location, digests, shared_cache):
    # after the test above: [10, 20) is cached; the last stage adds blocks 28, 29, the final
    # norm and the (tied) embedding, and fetches nothing else
    layout = gguf_layout(default_location.path).by_name
    new = ["output_norm.weight", "token_embd.weight"] + [n for n in layout if n.startswith(("blk.28.", "blk.29."))]
    servicer = Servicer(default_location, digests)
    result = fetch(servicer, (28, 30), shared_cache)
    assert result.bytes_fetched == sum(layout[n].size for n in new)
    assert result.bytes_reused == layout[HEADER].size

    again = fetch(servicer, (10, 20), shared_cache)
    assert again.bytes_fetched == 0 and again.calls == 0 and again.bytes_reused == again.bytes_needed
    assert len(servicer.fetch_calls) == 1  # only the (28, 30) fetch streamed anything

    hit = shard_transfer.cached_shard(shared_cache, MODEL, (28, 30))
    assert hit == result.location
    assert shard_transfer.cached_shard(shared_cache, MODEL, (0, 5)) is None
    assert shard_transfer.cached_shard(shared_cache, "another-model", (28, 30)) is None

    x = mx.random.normal((1, 3, 576), key=mx.random.key(3)).astype(mx.float32)
    logits = []
    for location in (default_location, result.location):
        stage = load_stage(location, 28, 30, dtype="float32")
        y = stage(x, stage.make_cache())
        mx.eval(y)
        logits.append(y)
    assert logits[0].shape == (1, 3, 49152)
    assert mx.array_equal(logits[0], logits[1]).item()


def test_a_corrupted_chunk_is_sent_again(default_location, digests, tmp_path):
    corrupter = shard_serve.ChunkCorrupter(3)
    servicer = Servicer(default_location, digests, corrupt=corrupter)
    result = fetch(servicer, (0, 4), tmp_path)
    assert len(corrupter.corrupted) == 1 and result.chunks_resent == 1
    assert len(servicer.fetch_calls) == 2  # everything, then the damaged chunk
    resent = servicer.fetch_calls[1].ranges
    bad = corrupter.corrupted[0]
    assert all(bad <= r.offset and r.offset + r.length <= bad + DEFAULT_CHUNK_BYTES for r in resent)
    assert 0 < result.bytes_fetched - result.bytes_needed <= DEFAULT_CHUNK_BYTES
    # every byte of every region the stage needs equals the original
    shard = LocalShard.load(result.location.path)
    names, _, _ = gguf_stage_names(result.location.path, 0, 4)
    layout = gguf_layout(default_location.path).by_name
    for name in [HEADER, *names]:
        r = layout[name]
        assert shard.is_verified(r)
        assert region_bytes(result.location.path, r.offset, r.size) == region_bytes(default_location.path, r.offset,
                                                                                     r.size), name


def test_a_broken_stream_is_resumed_without_fetching_twice(default_location, digests, tmp_path):
    servicer = Servicer(default_location, digests, fail_after=10)
    result = fetch(servicer, (3, 9), tmp_path)
    assert result.calls == 2 and servicer.fetch_calls[1].ranges  # resumed once
    assert result.bytes_fetched == result.bytes_needed  # the second call asked only for what was missing

    with pytest.raises(ShardError, match="UNAVAILABLE"):
        fetch(Servicer(default_location, digests, fail_after=5), (20, 25), tmp_path, retries=0)
    state = json.loads((result.location.path.parent / (result.location.path.name + STATE_SUFFIX)).read_text())
    assert state["chunks"], "the chunks received before the failure are recorded"
    result = fetch(Servicer(default_location, digests), (20, 25), tmp_path)
    assert 0 < result.bytes_fetched <= result.bytes_needed - 5 * 64 * 1024
    assert result.bytes_fetched + result.bytes_reused == result.bytes_needed


def test_a_cancelled_transfer_keeps_what_it_received(default_location, digests, tmp_path):
    servicer = Servicer(default_location, digests, delay_s=0.02)

    async def main():
        async with serving(servicer) as (stub, _):
            task = asyncio.create_task(shard_transfer.fetch_shard(stub, MODEL, (0, 12), tmp_path, progress=False))
            while servicer.served < 15:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    result = fetch(Servicer(default_location, digests), (0, 12), tmp_path)
    assert result.bytes_reused >= 10 * 1024 * 1024  # most of the 15 chunks were kept
    assert result.bytes_fetched + result.bytes_reused == result.bytes_needed


def test_a_killed_transfer_resumes_with_only_the_missing_bytes(default_location, digests, tmp_path):
    """kill -9 a client process mid-transfer; a new fetch gets only what it had not saved."""
    cache = tmp_path / "cache"
    client = textwrap.dedent("""
        import asyncio, sys
        from ringlet.daemon.shards import transfer as shard_transfer
        from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
        from ringlet.daemon.wire.transport import TransportConfig, make_channel

        async def main():
            channel = make_channel(TransportConfig(), sys.argv[1])
            await shard_transfer.fetch_shard(pb_grpc.RingStub(channel), "smollm2-135m", (0, 30), sys.argv[2],
                                             progress=False)

        asyncio.run(main())
    """)
    state_path = cache / MODEL / (default_location.path.name + STATE_SUFFIX)

    async def main():
        servicer = Servicer(default_location, digests, delay_s=0.05)  # ~100 chunks: a few seconds
        async with serving(servicer) as (_, address):
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", client, address, str(cache))
            try:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    try:
                        state = json.loads(state_path.read_text())
                    except (OSError, ValueError):
                        continue
                    if len(state["verified"]) > 20:
                        break
                else:
                    pytest.fail("the client saved no progress")
                proc.send_signal(signal.SIGKILL)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            return json.loads(state_path.read_text()), servicer.served

    saved, served = asyncio.run(main())
    layout = gguf_layout(default_location.path).by_name
    saved_bytes = sum(layout[n].size for n in saved["verified"])
    total = sum(r.size for r in layout.values())
    assert 0 < saved_bytes < total and served * DEFAULT_CHUNK_BYTES < total, "killed mid-transfer"
    result = fetch(Servicer(default_location, digests), (0, 30), cache)
    assert result.bytes_reused >= saved_bytes
    assert result.bytes_fetched == total - result.bytes_reused
    assert region_bytes(result.location.path, 0, total) == region_bytes(default_location.path, 0, total)


def test_a_node_with_a_fetched_copy_serves_only_what_it_holds(default_location, digests, shared_cache, tmp_path):
    """Second-hand transfer: the copy made from the original serves the ranges it has."""
    sparse = shard_transfer.cached_shard(shared_cache, MODEL, (10, 20))
    assert sparse is not None
    second = Servicer(ModelLocation(MODEL, "gguf", sparse.path), DigestCache(None))
    result = fetch(second, (12, 18), tmp_path)
    assert result.bytes_fetched == result.bytes_needed
    with pytest.raises(ShardError, match="holds only part of 'smollm2-135m'; it lacks blk.0"):
        fetch(second, (0, 4), tmp_path)  # blocks 0..3 and the embedding are not there

    async def ask_digest():
        async with serving(second) as (stub, _):
            await stub.ShardManifest(pb.ManifestRequest(model=MODEL, file=sparse.path.name,
                                                        digests=["blk.0.ffn_up.weight"]))

    with pytest.raises(grpc.aio.AioRpcError, match="holds only part of the model"):
        asyncio.run(ask_digest())


def test_bad_requests_are_refused(default_location, digests, tmp_path):
    servicer = Servicer(default_location, digests)
    with pytest.raises(PlanError):
        fetch(servicer, (25, 31), tmp_path)

    async def main():
        async with serving(servicer) as (stub, _):
            with pytest.raises(ShardError, match="NOT_FOUND.*serves the model"):
                await shard_transfer.fetch_shard(stub, "another-model", (0, 1), tmp_path, progress=False)
            name = default_location.path.name
            size = default_location.path.stat().st_size
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.FetchShard(pb.ShardRequest(model=MODEL, file=name,
                                                               ranges=[pb.ByteRange(offset=size - 10, length=20)])):
                    pass
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ShardManifest(pb.ManifestRequest(model=MODEL, file="../etc/passwd"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # chunks are cut on the absolute grid and resume_offset skips the bytes below it
            chunks = [c async for c in stub.FetchShard(pb.ShardRequest(
                model=MODEL, file=name, chunk_bytes=4096, resume_offset=5000,
                ranges=[pb.ByteRange(offset=1000, length=10000)]))]
            assert [(c.offset, len(c.data)) for c in chunks] == [(5000, 3192), (8192, 2808)]
            assert all(hashlib.sha256(c.data).digest() == c.sha256 for c in chunks)

    asyncio.run(main())
    for bad in ("../x", "/abs", "a/../b", ".hidden", "", "a//b"):
        with pytest.raises(ShardError):
            safe_rel(bad)


def test_source_digests_are_cached_on_disk(default_location, tmp_path):
    layout = gguf_layout(default_location.path)
    names = [HEADER, "blk.0.attn_q.weight"]
    first = DigestCache(tmp_path)
    got = first.digests(default_location.path, layout, names)
    assert first.hashed_bytes == sum(layout.region(n).size for n in names)
    for n in names:
        r = layout.region(n)
        assert got[n] == hashlib.sha256(region_bytes(default_location.path, r.offset, r.size)).digest()
    again = DigestCache(tmp_path)  # a restarted node
    assert again.digests(default_location.path, layout, names) == got and again.hashed_bytes == 0


def test_fast_gguf_header_parse_matches_the_gguf_package(default_location):
    import gguf

    header = read_gguf_header(default_location.path)
    reader = gguf.GGUFReader(str(default_location.path))
    assert header.header_bytes == reader.data_offset
    assert header.block_count == 30 and header.architecture == "llama"
    assert sorted(header.tensors) == sorted((t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors)


def test_progress_bar_on_a_terminal(monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    monkeypatch.setattr(sys, "stderr", out)
    bar = TransferProgress(True, "smollm2-135m [10, 20)")
    bar.start()
    bar.add_total(50_000_000)
    bar.advance(25_000_000)
    bar.stop()
    assert "smollm2-135m [10, 20)" in out.getvalue() and "25.0/50.0 MB" in out.getvalue()
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    off = TransferProgress(False, "x")
    off.start()
    off.advance(1)
    off.stop()
    assert quiet.getvalue() == ""


def test_damage_on_disk_is_found_and_repaired(default_location, digests, tmp_path):
    result = fetch(Servicer(default_location, digests), (14, 16), tmp_path)
    target = gguf_layout(default_location.path).by_name["blk.15.ffn_down.weight"]
    with open(result.location.path, "r+b") as fh:  # a bit flips on disk
        fh.seek(target.offset + 100)
        byte = fh.read(1)
        fh.seek(target.offset + 100)
        fh.write(bytes([byte[0] ^ 1]))
    shard = LocalShard.load(result.location.path)
    assert shard.reverify() == ["blk.15.ffn_down.weight"]
    assert shard_transfer.cached_shard(tmp_path, MODEL, (14, 16)) is None
    again = fetch(Servicer(default_location, digests), (14, 16), tmp_path)
    assert again.bytes_fetched == target.size
    assert region_bytes(again.location.path, target.offset, target.size) == region_bytes(
        default_location.path, target.offset, target.size)
