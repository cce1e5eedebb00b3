"""When the Hub fails at a prepare: take the stage's weight files from a member instead.

A member serving the same commit (``ORG/NAME@COMMIT``) that holds a whole file sends it
over the existing peer-to-peer transfer (``ShardManifest`` / ``FetchShard``,
:mod:`ringlet.daemon.shards.fetch`: chunked, each chunk and region checked against the
member's sha256, resumable). The copy is then checked against the sha256 the Hub listed
for the file (kept in the headers file since resolution) and moved into the Hugging Face
cache as its blob, with the snapshot's link beside the others: the cache ends as if
``huggingface_hub`` had downloaded it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from ringlet.daemon.engine.hub import RINGLET_DIR, HubModel
from ringlet.daemon.errors import RingletError
from ringlet.daemon.shards.fetch import FetchResult, fetch_file
from ringlet.daemon.shards.layout import HEADER
from ringlet.daemon.shards.local import safe_rel
from ringlet.daemon.shards.plan import describe_file, plan_file
from ringlet.daemon.shards.receiver import TransferProgress

log = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def _adopt(hub: HubModel, name: str, copy: Path, sha256: str) -> None:
    """Move a verified whole copy into the cache: ``blobs/<sha256>`` and the snapshot's
    relative link to it (how ``huggingface_hub`` lays out an LFS file)."""
    safe_rel(name)  # a name from the index: never a path outside the snapshot
    blob = hub.storage / "blobs" / sha256
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.replace(copy, blob)
    link = hub.snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        os.symlink(os.path.relpath(blob, link.parent), link)


async def _from_member(stub, hub: HubModel, name: str, staging: Path) -> None:

    described = await describe_file(stub, hub.ident, name)
    regions = [r for r in described[1] if r != HEADER]
    plan = await plan_file(stub, hub.ident, name, regions, described)
    result = FetchResult(location=None, layer_range=(0, 0), regions=0, bytes_needed=0, bytes_reused=0,
                         bytes_fetched=0, chunks_resent=0, calls=0, seconds=0.0, allocated_bytes=0)
    bar = TransferProgress(False, name)
    shard = await fetch_file(stub, hub.ident, staging, plan, bar, 0, 3, 8, result)
    expected = hub.files[name].sha256
    got = _sha256(shard.path)
    if got != expected:
        raise RingletError(f"{name} from the member does not match the Hub's sha256 ({got[:16]}…, expected "
                           f"{expected[:16]}…)")
    Path(str(shard.path) + ".shard.json").unlink(missing_ok=True)
    _adopt(hub, name, shard.path, expected)


async def fetch_from_members(node, hub: HubModel, names: list[str], hub_error: str) -> str:
    """Fetch the whole files ``names`` of ``hub``'s commit from the first member holding
    each; returns what served them (for the event log).

    Raises:
        RingletError: a file without the Hub's sha256 (it could not be verified), or no
            member served some file; the message names the Hub's error too.
    """
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

    membership = getattr(getattr(node, "cluster", None), "membership", None)
    members = list(membership.members.values()) if membership is not None else []
    staging = hub.storage / RINGLET_DIR / "peer"
    served: set[str] = set()
    for name in names:
        sha = hub.files[name].sha256 if name in hub.files else None
        if not (sha and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise RingletError(f"the Hub failed ({hub_error}) and {name} has no sha256 from it to check a "
                               "member's copy against")
        errors = []
        for member in members:
            try:
                await _from_member(pb_grpc.RingStub(membership.channel(member.address)), hub, name, staging)
            except Exception as exc:  # noqa: BLE001 - try the next member
                errors.append(f"{member.node_id[:8]}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                continue
            served.add(member.node_id[:8])
            log.info("%s: %s from member %s (the Hub failed: %s)", hub.ident, name, member.node_id[:8], hub_error)
            break
        else:
            raise RingletError(f"cannot download {name} of {hub.ident}: the Hub failed ({hub_error}) and no member "
                               f"served it ({'; '.join(errors) or 'no members'})")
    return "member(s) " + ", ".join(sorted(served))
