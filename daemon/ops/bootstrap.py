"""A node started without the model's files (``--fetch-model``, or a Hub model that
neither the Hub nor the cache has) takes the model's header from a member.

The members come from ``--peers`` or mDNS. A member that is still starting, or that
lacks the model itself (another node bootstrapping beside this one), is not the end: every
address found is tried, again every ``RETRY_S``, until one serves the model or
``WAIT_S`` has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path

from ringlet.daemon.engine.sources import KNOWN_MODELS, resolve
from ringlet.daemon.errors import ModelNotFound, RingletError
from ringlet.daemon.ops.secret import transport_config
from ringlet.daemon.paths import machine_cache_dir

log = logging.getLogger(__name__)

#: Seconds a node looks for a member that serves the model before it gives up (mDNS
#: answers within ~1 s on a LAN; the rest covers members still loading their own stage).
WAIT_S = 30.0
#: Seconds before an address that failed is tried again.
RETRY_S = 2.0


async def _try_member(args, address: str, name: str, cache_dir: Path):
    """Pull the model's header and layer 0 from the member at ``address``; returns the
    fetch's result. Raises whatever the transfer raises."""
    from ringlet.daemon.shards.transfer import fetch_shard_detailed
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
    from ringlet.daemon.wire.transport import make_channel

    channel = make_channel(transport_config(args, "bootstrap"), address)
    try:
        return await fetch_shard_detailed(pb_grpc.RingStub(channel), name, (0, 1), cache_dir,
                                          progress=sys.stderr.isatty())
    finally:
        await channel.close()


async def _from_members(args, name: str, cache_dir: Path):
    """The first member (``--peers``, else mDNS) to serve ``name``: ``(address, result)``.

    Raises:
        RingletError: none did within :data:`WAIT_S`; names every address tried and why.
    """
    from ringlet.daemon.cluster.advert import Advert
    from ringlet.daemon.cluster.discovery import Discovery
    from ringlet.daemon.cluster.identity import NodeIdentity
    from ringlet.daemon.cluster.static_peers import parse_peers

    found: list[str] = [f"{h}:{p}" for h, p in parse_peers(args.peers)] if args.peers else []
    errors: dict[str, str] = {}
    tried: dict[str, float] = {}  # address -> when it was last tried (monotonic s)

    def on_peer(advert: Advert) -> None:
        for host in advert.addresses:
            if (address := f"{host}:{advert.grpc_port}") not in found:
                found.append(address)

    async with contextlib.AsyncExitStack() as stack:
        if not found and not args.no_mdns:
            data_dir = Path(args.data_dir).expanduser() if args.data_dir else None
            ident = stack.enter_context(NodeIdentity.load_or_create(data_dir))
            disc = Discovery.for_identity(
                ident, args.cluster, args.port, args.api_port, interfaces=args.interface or None, on_peer=on_peer)
            await disc.start()
            stack.push_async_callback(disc.stop)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            due = [a for a in list(found) if a not in tried or now - tried[a] >= RETRY_S]
            for address in due:
                tried[address] = time.monotonic()
                try:
                    return address, await _try_member(args, address, name, cache_dir)
                except Exception as exc:  # noqa: BLE001 - another member, or this one later
                    errors[address] = str(exc).splitlines()[0] if str(exc) else repr(exc)
                    log.info("model %s: member %s did not serve it (%s); still looking", name, address,
                             errors[address])
            await asyncio.sleep(0.2)
    tried_text = "; ".join(f"{a}: {e}" for a, e in errors.items()) or "no member found; pass --peers"
    raise RingletError(f"model {name!r} is not on this machine and no member served it within {WAIT_S:.0f} s "
                       f"({tried_text})")


async def bootstrap_fetch(args, hub_name: str | None = None) -> None:
    """``--fetch-model`` on a node without the model files: find a member (``--peers`` or
    mDNS), pull the model's header (tokenizer, config) and first layer into the local
    sparse copy, and serve from that copy (the rest is pulled per stage at prepare). Sets
    ``args.fetched_location``, ``args.fetch_cache_dir`` and ``args.fetch_events``.
    ``hub_name``: a Hub model (``ORG/NAME[@COMMIT]``) neither the Hub nor the cache has.

    Raises:
        RingletError: no member served the model within :data:`WAIT_S` seconds.
    """
    from ringlet.daemon.shards.transfer import cached_shard

    try:
        if hub_name is None:
            resolve(args.model)
            return  # the files are here after all
    except ModelNotFound:
        pass
    name = (args.model or "smollm2-135m").lower() if (args.model or "smollm2-135m").lower() in KNOWN_MODELS \
        else hub_name or Path(args.model).stem
    cache_dir = (Path(args.data_dir).expanduser() if args.data_dir else machine_cache_dir()) / "shards"
    local = cached_shard(cache_dir, name, (0, 1)) if hub_name is None else None
    if local is None:
        address, result = await _from_members(args, name, cache_dir)
        local = result.location
        args.fetch_events = [f"model header and layers [0, 1) from {address}: "
                             f"{result.bytes_fetched / 1e6:.1f} MB in {result.seconds:.2f} s, "
                             f"{result.chunks_resent} chunk(s) re-sent after a failed check"]
    log.info("model %s: serving from the local partial copy %s (shards are pulled from members)", name, local.path)
    args.fetched_location = local
    args.fetch_cache_dir = cache_dir
