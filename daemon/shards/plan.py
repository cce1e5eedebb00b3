"""Receiving side of a shard transfer: what to fetch of one file, from the peer's manifest.

``ShardManifest`` describes a file as regions (:mod:`ringlet.daemon.shards.layout`) with
the source's sha256 of the regions asked for; :func:`plan_file` turns that into a
:class:`FilePlan` (the file's identity, the regions needed and the digests they must
have). :func:`rpc_call` is the control-RPC call with its rate-limit retry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from ringlet.daemon.shards.layout import Region, ShardError
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


async def rpc_call(call, request, what: str, attempts: int = 5):
    """``await call(request)``, retried (up to ``attempts`` times) when the peer's control-RPC
    rate limit answers RESOURCE_EXHAUSTED, after the ``retry-after-ms`` it names.

    Raises:
        ShardError: the call failed (naming ``what`` and the gRPC status).
    """
    for attempt in range(attempts):
        try:
            return await call(request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == attempts - 1:
                raise ShardError(f"{what}: {exc.code().name}: {exc.details()}") from None
            wait_ms = next((v for k, v in (exc.trailing_metadata() or ()) if k == "retry-after-ms"), "100")
            await asyncio.sleep(min(2.0, int(wait_ms) / 1000 if str(wait_ms).isdigit() else 0.1))
    raise AssertionError("unreachable")


def _manifest_regions(f: pb.ShardFile) -> tuple[dict[str, Region], dict[str, bytes]]:
    regions, digests = {}, {}
    for r in f.regions:
        if r.offset + r.size > f.size:
            raise ShardError(f"{f.path}: the peer's manifest puts {r.name} beyond the end of the file")
        regions[r.name] = Region(r.name, int(r.offset), int(r.size))
        if r.sha256:
            if len(r.sha256) != 32:
                raise ShardError(f"{f.path}: the peer's sha256 of {r.name} is not 32 bytes")
            digests[r.name] = bytes(r.sha256)
    return regions, digests


@dataclass
class FilePlan:
    """What to fetch of one file: its identity (size, sha256 of its first region: the
    header, or the whole small file), the regions needed and their digests."""

    rel: str
    size: int
    version: bytes
    regions: dict[str, Region]
    needed: list[Region]
    expected: dict[str, bytes]


async def describe_file(stub, model: str, rel: str, digests: list[str] | None = None):
    """``(ShardFile, regions by name, digests by name)`` of one file from the peer."""
    desc = await rpc_call(stub.ShardManifest, pb.ManifestRequest(model=model, file=rel, digests=digests or []),
                          "ShardManifest")
    if len(desc.files) != 1 or desc.files[0].path != rel:
        raise ShardError(f"{rel}: the peer's manifest describes another file")
    f = desc.files[0]
    regions, got = _manifest_regions(f)
    first = f.regions[0] if f.regions else None
    if first is None or first.offset != 0 or first.name not in got:
        raise ShardError(f"{rel}: the peer's manifest has no first region with a sha256")
    return f, regions, got


async def plan_file(stub, model: str, rel: str, names: list[str], described=None) -> FilePlan:
    """The plan for ``rel``: its first region (header / whole file) and the regions ``names``,
    with their digests from the peer.

    Raises:
        ShardError: the peer lacks some of them (a partial copy) or sent no digest.
    """
    f, regions, got = described or await describe_file(stub, model, rel)
    first = f.regions[0].name
    lacking = [r.name for r in f.regions if r.missing and (r.name in names or r.name == first)]
    if lacking:
        raise ShardError(f"the peer holds only part of {model!r}; it lacks {lacking[0]}"
                         + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else "") + f" (in {rel})")
    expected = {first: got[first]}
    if names:
        _, _, more = await describe_file(stub, model, rel, names)
        if any(n not in more for n in names):
            raise ShardError(f"{rel}: the peer sent no sha256 for some of the regions asked for")
        expected.update(more)
    needed = [regions[first]] + [regions[n] for n in names if n != first]
    return FilePlan(rel, int(f.size), got[first], regions, needed, expected)
