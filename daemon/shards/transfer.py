"""Peer-to-peer shard transfer: a node without the model files pulls its stage's bytes from a member.

This module is the receiver's entry point: :func:`fetch_shard` (and
:func:`fetch_shard_detailed`) fetch, verify and cache a stage's shard; :func:`cached_shard`
finds one already cached, without the network. The serving side is
:mod:`ringlet.daemon.shards.serve` (wire: ``ShardManifest`` and ``FetchShard`` in
``proto/ringlet.proto``).

The receiver builds a sparse copy of the file (the header plus the tensors of its layer
range, at their original offsets; :mod:`ringlet.daemon.shards.local`) under
``<cache_dir>/<model>/<file>``; the loaders in :mod:`ringlet.daemon.engine.stage` read it
unchanged. What to fetch comes from the peer's manifest (:mod:`ringlet.daemon.shards.plan`)
and the stage's tensor selection (:mod:`ringlet.daemon.shards.selection`); the bytes travel
in :mod:`ringlet.daemon.shards.fetch` and are checked per region and per chunk in
:mod:`ringlet.daemon.shards.receiver`. Resumable and durable: a transfer that stops
fetches only the missing bytes next time, and a warm cache fetches nothing.

An MLX/Hugging Face directory is fetched as its small files whole (config, tokenizer,
chat template) plus, for each ``*.safetensors`` file, its header and the stage's tensors
(sparse, like a GGUF file); ``mlx-lm``'s lazy loading reads only those.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.shards.fetch import FetchResult, fetch_file
from ringlet.daemon.shards.layout import HEADER, STATE_SUFFIX, WHOLE, Region, ShardError, safetensors_layout
from ringlet.daemon.shards.local import LocalShard, safe_rel
from ringlet.daemon.shards.plan import FilePlan, describe_file, plan_file, rpc_call
from ringlet.daemon.shards.receiver import TransferProgress
from ringlet.daemon.shards.selection import gguf_block_count, gguf_stage_names, select_gguf, select_mlx
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: Files of a fetched MLX directory, beside it (hidden: never served or loaded as a model file).
MLX_FILE_LIST = ".shard-files.json"


def model_dir_name(name: str) -> str:
    """The cache directory of a model's copy: its name, a Hub model's ``ORG/NAME@COMMIT``
    as ``ORG--NAME@COMMIT``.

    Raises:
        ShardError: a name that is not a plain directory name.
    """
    if not name or name.count("/") > 1:
        raise ShardError(f"refusing the model name {name!r} as a cache directory")
    return safe_rel(name.replace("/", "--"))


async def fetch_shard_detailed(stub, model_name: str, layer_range: tuple[int, int], cache_dir: Path | str,
                               progress: bool = True, *, chunk_bytes: int = 0, retries: int = 3,
                               max_rounds: int = 8) -> FetchResult:
    """Fetch, verify and cache the shard of ``layer_range`` from the peer behind ``stub``.

    Args:
        stub: a ``ringlet_pb2_grpc.RingStub`` on a channel from
            :func:`ringlet.daemon.wire.transport.make_channel` to a member holding the model.
        model_name: the model's name as the member serves it (``ModelLocation.name``,
            ``NodeInfo.model``).
        layer_range: half-open ``(start, end)``; the first stage also gets the
            embedding, the last the final norm and the head (the embedding when tied).
        cache_dir: the copy goes to ``<cache_dir>/<model name>/`` (a GGUF: its one file;
            an MLX directory: its files), each file with its state ``<file>.shard.json``
            beside it; reused and extended by later calls.
        progress: show a rich progress bar on stderr (only when it is a terminal).
        chunk_bytes: chunk size to ask for, bytes (0 = the server's default, 1 MiB, whose
            chunk digests the server caches).
        retries: how many times a broken stream (peer restarted, network glitch) is
            resumed before giving up.
        max_rounds: most ``FetchShard`` calls for re-sent chunks before giving up.

    Returns:
        :class:`~ringlet.daemon.shards.fetch.FetchResult`; ``result.location`` (``kind`` ``"gguf"``: the sparse file;
        ``"mlx"``: the directory) loads with :func:`ringlet.daemon.engine.stage.load_stage` for
        any range within ``layer_range``, and its tokenizer with
        :func:`ringlet.daemon.engine.model_info.load_tokenizer`.

    Raises:
        ShardError: the peer does not serve the model or lacks the bytes, an RPC failed
            (after ``retries``), data failed verification repeatedly, or another
            transfer is writing the same file.
        PlanError: a layer range outside the model.
        ModelFormatError: the peer's files are not a usable GGUF / safetensors layout.
        OSError: the cache directory is not writable.
    """
    t0 = time.perf_counter()
    start, end = int(layer_range[0]), int(layer_range[1])
    files = await rpc_call(stub.ShardManifest, pb.ManifestRequest(model=model_name), "ShardManifest")
    model = files.model
    directory = Path(cache_dir) / model_dir_name(model)
    bar = TransferProgress(progress, f"{model} [{start}, {end})")
    result = FetchResult(location=ModelLocation(model, files.kind, directory), layer_range=(start, end), regions=0,
                         bytes_needed=0, bytes_reused=0, bytes_fetched=0, chunks_resent=0, calls=0, seconds=0.0,
                         allocated_bytes=0)

    async def get(plan: FilePlan) -> LocalShard:
        result.regions += len(plan.needed)
        return await fetch_file(stub, model, directory, plan, bar, chunk_bytes, retries, max_rounds, result)

    bar.start()
    try:
        if files.kind == "gguf" and len(files.files) == 1:
            plan = await _plan_gguf(stub, model, safe_rel(files.files[0].path), start, end)
            shard = await get(plan)
            # The verified header must describe the tensors as the manifest did.
            local_names, local, _ = gguf_stage_names(shard.path, start, end)
            if local_names != [r.name for r in plan.needed[1:]] or any(local[r.name] != r for r in plan.needed[1:]):
                raise ShardError(f"{plan.rel}: the peer's manifest does not describe the tensors of [{start}, {end}) "
                                 "as the file's own header does")
            result.location = ModelLocation(model, "gguf", shard.path)
            shards = [shard]
        elif files.kind == "mlx":
            shards = await _fetch_mlx(stub, model, files, directory, start, end, get)
        else:
            raise ShardError(f"the peer serves {model!r} as {files.kind!r} with {len(files.files)} files; "
                             "ringlet fetches GGUF files and MLX directories")
    finally:
        bar.stop()
    result.allocated_bytes = sum(s.allocated_bytes() for s in shards)
    result.seconds = time.perf_counter() - t0
    log.info("shard %s [%d, %d): %d bytes fetched, %d reused, %d chunk(s) re-sent, %.2f s", model, start,
             end, result.bytes_fetched, result.bytes_reused, result.chunks_resent, result.seconds)
    return result


async def _plan_gguf(stub, model: str, rel: str, start: int, end: int) -> FilePlan:
    described = await describe_file(stub, model, rel)
    _, regions, _ = described
    tensors = {n: r for n, r in regions.items() if n != HEADER}
    return await plan_file(stub, model, rel, select_gguf(tensors, gguf_block_count(tensors), start, end), described)


async def _fetch_mlx(stub, model: str, files: pb.Manifest, directory: Path, start: int, end: int, get):
    """Fetch an MLX directory's small files whole, then the stage's tensors of each
    safetensors file (its header + tensors, sparse). Returns the local shards."""
    shards = []
    for f in files.files:
        safe_rel(f.path)
        if f.format not in ("whole", "safetensors"):
            raise ShardError(f"{f.path}: unknown file format {f.format!r} from the peer")
    for f in files.files:  # config.json first: it says how many layers there are
        if f.format == "whole":
            shards.append(await get(await plan_file(stub, model, f.path, [])))
    try:
        config = json.loads((directory / "config.json").read_text())
        config = config.get("text_config", config)
        num_layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ShardError(f"{model}: the peer's config.json has no num_hidden_layers") from None
    described = {f.path: await describe_file(stub, model, f.path) for f in files.files if f.format == "safetensors"}
    if not described:
        raise ShardError(f"{model}: the peer lists no safetensors files")
    every = [n for _, regions, _ in described.values() for n in regions if n != HEADER]
    wanted = set(select_mlx(every, num_layers, start, end))
    for rel, d in described.items():
        names = [n for n in d[1] if n in wanted]
        shard = await get(await plan_file(stub, model, rel, names, d))
        local = safetensors_layout(shard.path, rel).by_name
        if any(local.get(n) != d[1][n] for n in names):
            raise ShardError(f"{rel}: the peer's manifest does not describe the tensors as the file's own header "
                             "does")
        shards.append(shard)
    (directory / MLX_FILE_LIST).write_text(json.dumps({"files": [f.path for f in files.files]}))
    return shards


async def fetch_shard(stub, model_name: str, layer_range: tuple[int, int], cache_dir: Path | str,
                      progress: bool = True, **kwargs) -> ModelLocation:
    """Fetch the shard of ``layer_range`` into ``cache_dir`` and return its local location;
    see :func:`fetch_shard_detailed` for the arguments and errors."""
    return (await fetch_shard_detailed(stub, model_name, layer_range, cache_dir, progress, **kwargs)).location


def cached_shard(cache_dir: Path | str, model_name: str, layer_range: tuple[int, int]) -> ModelLocation | None:
    """The local sparse copy of ``model_name`` under ``cache_dir`` if it already holds every
    verified region the stage ``layer_range`` needs, else ``None``. No network: reads the
    state files and the local headers (milliseconds)."""
    start, end = int(layer_range[0]), int(layer_range[1])
    try:
        directory = Path(cache_dir) / model_dir_name(model_name)
    except ShardError:
        return None
    if not directory.is_dir():
        return None
    try:
        listing = json.loads((directory / MLX_FILE_LIST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listing = None
    try:
        if listing is not None:  # an MLX directory
            shards = {rel: LocalShard.load(directory / safe_rel(rel)) for rel in listing}
            if any(s is None or s.rel != rel for rel, s in shards.items()):
                return None
            config = json.loads((directory / "config.json").read_text())
            num_layers = int(config.get("text_config", config)["num_hidden_layers"])
            layouts = {rel: safetensors_layout(s.path, rel).by_name for rel, s in shards.items()
                       if rel.endswith(".safetensors")}
            wanted = set(select_mlx([n for lay in layouts.values() for n in lay if n != HEADER], num_layers,
                                    start, end))
            for rel, shard in shards.items():
                if rel in layouts:
                    regions = layouts[rel]
                    names = [HEADER] + [n for n in regions if n in wanted]
                else:  # a small file fetched whole: one region, the size of the file
                    regions = {WHOLE: Region(WHOLE, 0, shard.size)}
                    names = [WHOLE]
                if not all(shard.is_verified(regions[n]) for n in names):
                    return None
            return ModelLocation(model_name, "mlx", directory)
        for state in sorted(directory.glob("*.gguf" + STATE_SUFFIX)):
            shard = LocalShard.load(state.with_name(state.name[: -len(STATE_SUFFIX)]))
            if shard is None or HEADER not in shard.verified or not shard.path.is_file():
                continue
            names, local, _ = gguf_stage_names(shard.path, start, end)
            if all(shard.is_verified(local[n]) for n in names):
                return ModelLocation(model_name, "gguf", shard.path)
    except Exception as exc:  # noqa: BLE001 - an unusable cache is just not a hit
        log.debug("shard cache %s unusable: %s", directory, exc)
    return None
