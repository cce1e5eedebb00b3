"""``ringlet run --model ORG/NAME[@REVISION]``: the daemon's side of Hub models.

* At start (:func:`resolve_run_model`): the name resolves through ``huggingface_hub``
  (:func:`ringlet.daemon.engine.hub.resolve_hub`) to a commit, with the config, the
  tokenizer and every safetensors header, and the node serves the snapshot directory in
  the Hugging Face cache: it sizes the model and plans before any weight arrives.
  Without the Hub and with nothing cached, a member that has the model serves it over
  the existing peer-to-peer transfer (``--peers`` or mDNS), else one error says what to
  do.
* At each prepare (:func:`hub_fetcher`): the node downloads only the safetensors files
  holding its new stage's tensors that the cache lacks (a re-shard downloads only the
  files of newly assigned layers), after checking the disk, with progress in
  ``/v1/cluster`` (``download``) and on the terminal. When the Hub fails then, a member
  holding those files sends them (:mod:`ringlet.daemon.ops.hub_peers`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

from ringlet.daemon.engine.hub import HubModel, HubUnavailable, parse_ref, resolve_hub
from ringlet.daemon.errors import RingletError
from ringlet.daemon.shards.hub_fetch import DownloadProgress, download, stage_weight_files, total_bytes
from ringlet.daemon.shards.layout import ShardError

log = logging.getLogger(__name__)


async def resolve_run_model(args, bootstrap) -> None:
    """Resolve ``args.model`` when it is a Hub name; sets ``args.hub`` (a
    :class:`~ringlet.daemon.engine.hub.HubModel`) and ``args.fetched_location`` (its
    snapshot). Without the Hub and the cache, ``await bootstrap(args, name)`` pulls the
    model's header from a member (``--peers`` or mDNS), when the node may look for one.

    Raises:
        HubUnavailable: neither the Hub, the cache nor a member has the model.
        ModelNotFound, ModelFormatError: no such repository or revision, not a
            safetensors model.
    """
    ref = parse_ref(args.model)
    if ref is None:
        return
    try:
        hub = await asyncio.to_thread(resolve_hub, ref)
    except HubUnavailable as exc:
        if not args.peers and args.no_mdns:
            raise
        log.info("%s; asking the members", exc)
        try:
            await bootstrap(args, str(ref))
        except RingletError as peer_exc:
            raise HubUnavailable(f"{exc}; no member served it either ({peer_exc})") from None
        location = args.fetched_location
        name, _, revision = location.name.partition("@")
        args.fetched_location = replace(location, name=name, revision=revision or None)
        return
    for note in hub.notes:
        log.warning("%s: %s", hub.ident, note)
    log.info("model %s: commit %s (%s); %d of %d weight files in the cache %s", ref, hub.revision,
             f"offline: {hub.why}" if hub.offline else hub.endpoint,
             sum(hub.cached(f) for f in hub.weight_files), len(hub.weight_files), hub.snapshot)
    args.hub = hub
    args.fetched_location = hub.location()


def hub_fetcher(node, hub: HubModel):
    """``await fetch(start, end)``: bring the files of the stage ``[start, end)`` into the
    cache before the node loads it (the node's ``config.fetch``).

    Raises (from ``fetch``):
        RingletError: not enough disk space; the Hub and the members failed (naming both).
        ShardError: a download failed verification.
    """

    async def fetch(start: int, end: int) -> None:
        names = stage_weight_files(hub, start, end)
        todo = [n for n in names if not hub.cached(n)]
        if not todo:
            return
        what = f"{hub.repo} layers [{start}, {end})"
        progress = DownloadProgress(what, total_bytes(hub, todo), len(todo))
        node.download = progress
        cancel = threading.Event()
        t0 = time.monotonic()
        source = "the Hub"
        try:
            try:
                await asyncio.to_thread(download, hub, todo, progress, cancel)
            except (ShardError, RingletError):
                raise
            except Exception as exc:  # noqa: BLE001 - the Hub failed: the members may have the files
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("%s: the Hub failed (%s); asking the members", what, why)
                from ringlet.daemon.ops.hub_peers import fetch_from_members

                source = await fetch_from_members(node, hub, [n for n in todo if not hub.cached(n)], why)
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            node.download = None
        got = progress.to_dict()
        node.event("download", f"layers [{start}, {end}): {len(todo)} file(s), {got['bytes_done'] / 1e6:.1f} MB "
                               f"from {source} in {time.monotonic() - t0:.1f} s")

    return fetch
