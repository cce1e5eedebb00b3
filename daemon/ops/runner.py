"""``ringlet run``: one daemon process — identity, probes, discovery, membership,
negotiation, the serving node, its gRPC server and its HTTP API.

With ``--plan`` the node serves that static plan (an explicit override). Without
it the node finds its peers (mDNS, ``--peers``, gossip), and the members agree on
plans by negotiation (:mod:`ringlet.daemon.cluster.negotiation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import sys
import time
from pathlib import Path

from ringlet.daemon.api.tokenizer import LazyTokenizer
from ringlet.daemon.cluster.addresses import log_skipped_interfaces
from ringlet.daemon.cluster.static_plan import parse_plan, validate
from ringlet.daemon.engine.defaults import DEFAULT_MAX_BATCH
from ringlet.daemon.engine.drafting import DEFAULT_SPEC_TOKENS
from ringlet.daemon.engine.dtype import DtypeChoice, resolve_dtype
from ringlet.daemon.engine.hub import parse_ref
from ringlet.daemon.engine.memory_tuning import tune_allocator
from ringlet.daemon.engine.model_info import load_tokenizer, model_info
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.errors import PlanError, RingletError
from ringlet.daemon.node import Node, NodeConfig
from ringlet.daemon.ops.bootstrap import bootstrap_fetch
from ringlet.daemon.ops.hub_run import hub_fetcher, resolve_run_model
from ringlet.daemon.ops.lane_child import lane_reserver, lane_start
from ringlet.daemon.ops.memory_follow import MemoryFollower, configured_memory
from ringlet.daemon.ops.run_options import DRAIN_TIMEOUT_S, parse_size
from ringlet.daemon.ops.secret import api_limits, transport_config
from ringlet.daemon.ops.terminal import drawn, foreground_terminal, own_dashboard
from ringlet.daemon.paths import machine_cache_dir, prefix_cache_dir
from ringlet.daemon.probes.colocated import DIR_NAME as PROCS_DIR
from ringlet.daemon.probes.colocated import ThreadSizer
from ringlet.daemon.wire import versions

log = logging.getLogger(__name__)


def build_config(args) -> tuple[NodeConfig, int]:
    """Resolve the model and the (optional) static plan from CLI arguments.

    Returns ``(config, context tokens)``.

    Raises:
        ModelNotFound, ModelFormatError, PlanError: with a message naming the problem.
    """
    location = getattr(args, "fetched_location", None) or resolve(args.model)
    info = model_info(location)
    address = f"{args.host}:{args.port}"
    plan = None
    if args.plan:
        plan = parse_plan(args.plan)
        validate(plan, info.num_layers)
        if address not in {s.address for s in plan}:
            raise PlanError(f"this node's address {address} is not a stage of --plan; pass --host/--port to match")
    choice = node_dtype(args, location)
    return NodeConfig(host=args.host, port=args.port, model=location, plan=plan, dtype=choice.dtype,
                      dtype_choice=choice.to_dict(),
                      prefix_cache_bytes=parse_size(getattr(args, "prefix_cache_bytes", None), "--prefix-cache-bytes",
                                                    allow_zero=True),
                      prefix_cache_scope=getattr(args, "prefix_cache_scope", "key"),
                      kv_migration=getattr(args, "kv_migration", "on") == "on",
                      boundary_cache_bytes=parse_size(getattr(args, "boundary_cache_bytes", None),
                                                      "--boundary-cache-bytes", allow_zero=True),
                      prefix_cache_disk_bytes=parse_size(getattr(args, "prefix_cache_disk_bytes", "0"),
                                                         "--prefix-cache-disk-bytes", allow_zero=True) or 0,
                      prefix_cache_dir=prefix_cache_dir(getattr(args, "data_dir", None), address, plan is not None),
                      usable_memory_bytes=configured_memory(args),  # --memory-limit, or the cgroup's
                      node_id=getattr(args, "node_id", "") or "",
                      max_batch=getattr(args, "max_batch", DEFAULT_MAX_BATCH),
                      prefill_chunk=getattr(args, "prefill_chunk", None),
                      spec_tokens=max(0, getattr(args, "spec_tokens", DEFAULT_SPEC_TOKENS)),
                      transport=transport_config(args, getattr(args, "node_id", "") or address),
                      vocab_size=info.vocab_size, context_tokens=info.context_tokens), \
        info.context_tokens


def load_draft_model(name: str, config: NodeConfig, served_tokenizer):
    """``--draft-model``: the model ``name`` (resolved as ``--model`` is), loaded whole
    in the served model's dtype, once its tokenizer is checked to be the served model's
    (``served_tokenizer``: the node's :class:`~ringlet.daemon.api.tokenizer.LazyTokenizer`,
    built here, so the API uses the same one instead of building it again).

    Raises:
        RingletError: it cannot be found or loaded, or its tokenizer differs.
    """
    from ringlet.daemon.engine.draft_model import DraftModel, DraftModelError, check_tokenizers
    from ringlet.daemon.engine.stage import load_stage

    try:
        location = resolve(name)
        check_tokenizers(load_tokenizer(location), served_tokenizer.get_blocking(), location.name,
                         config.model.name)
        stage = load_stage(location, 0, dtype=config.dtype)
    except DraftModelError as exc:
        raise RingletError(str(exc)) from None
    except RingletError as exc:
        raise RingletError(f"--draft-model {name}: {exc}") from None
    log.info("draft model %s: %d layers, drafting for %s", location.name, stage.num_layers, config.model.name)
    return DraftModel(stage, vocab=config.vocab_size or 1 << 31, name=location.name)


def node_dtype(args, location) -> DtypeChoice:
    """``--dtype`` resolved for this node against its usable memory (``--memory-limit``,
    else the memory probe); logged once."""
    from ringlet.daemon.probes.memory import probe_memory

    usable = parse_size(getattr(args, "memory_limit", None)) or probe_memory().usable_memory_bytes
    requested = getattr(args, "dtype", None)
    try:
        choice = resolve_dtype(requested, location, usable)
    except ValueError:
        raise
    except Exception as exc:  # an unreadable model: the loader reports it with its own clear error
        log.debug("cannot size %s for --dtype: %s", location.name, exc)
        fallback = None if requested in (None, "auto", "native") else requested
        choice = DtypeChoice(fallback, requested or "auto", "the model could not be sized; loading as given")
    log.info("dtype: %s", choice.reason)
    return choice


def _make_fetcher(node: Node, membership, cache_dir: Path):
    """``fetch(start, end)``: pull a stage's tensors from the first member that serves them."""
    from ringlet.daemon.shards.transfer import cached_shard, fetch_shard_detailed
    from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

    name = node.config.model.ident  # a Hub model: name@commit, so a member of another commit refuses

    async def fetch(start: int, end: int) -> None:
        if cached_shard(cache_dir, name, (start, end)) is not None:
            return
        errors = []
        for member in list(membership.members.values()):
            try:
                result = await fetch_shard_detailed(pb_grpc.RingStub(membership.channel(member.address)), name,
                                                    (start, end), cache_dir, progress=sys.stderr.isatty())
            except Exception as exc:  # noqa: BLE001 - try the next member
                errors.append(f"{member.node_id}: {exc}")
                continue
            node.event("fetch", f"layers [{start}, {end}) from {member.node_id[:8]}: "
                                f"{result.bytes_fetched / 1e6:.1f} MB in {result.seconds:.2f} s, "
                                f"{result.chunks_resent} chunk(s) re-sent after a failed check")
            return
        raise RingletError(f"no member served layers [{start}, {end}) of {name}: {'; '.join(errors) or 'none'}")

    return fetch


async def _start_cluster(args, node: Node, context_tokens: int):
    """Identity, probes, membership, negotiation and discovery for a negotiated node."""
    from ringlet.daemon.cluster.discovery import Discovery
    from ringlet.daemon.cluster.features import required_by
    from ringlet.daemon.cluster.identity import NodeIdentity, cluster_id
    from ringlet.daemon.cluster.membership import Membership
    from ringlet.daemon.cluster.negotiation import Negotiator
    from ringlet.daemon.cluster.netwatch import AddressWatcher, NetworkFollower
    from ringlet.daemon.cluster.router import LINK_REFRESH_S, Router
    from ringlet.daemon.cluster.static_peers import parse_peers
    from ringlet.daemon.engine.modelspec import model_spec_from_model
    from ringlet.daemon.engine.stage import build_lazy_model
    from ringlet.daemon.engine.work_space import tokenizer_bytes, work_space_bytes
    from ringlet.daemon.node.memory import set_cache_limit
    from ringlet.daemon.probes import probe_local
    from ringlet.daemon.tensor.group import model_tp_spec
    from ringlet.daemon.tensor.serving.core import TPServing
    from ringlet.daemon.tensor.serving.thunderbolt import thunderbolt_record
    from ringlet.partitioning import Policy

    loop = asyncio.get_running_loop()
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else None
    identity = NodeIdentity.load_or_create(data_dir)
    node.node_id = identity.node_id
    node.cluster_id = cluster_id(args.cluster)
    node.incarnation = identity.incarnation
    # Speeds are a property of the machine: cache them machine-wide, so daemons that
    # share a machine plan with the same figures instead of each its own noisy one.
    cache_dir = machine_cache_dir()
    probe = await loop.run_in_executor(None, lambda: probe_local(cache_dir))
    memory = MemoryFollower(node, probe.memory,  # lowest: probe, --memory-limit (as given), a lane's share
                            parse_size(getattr(args, "memory_limit_given", args.memory_limit)),
                            share_file=getattr(args, "lane_share_file", None))
    speed = probe.speed
    watcher = AddressWatcher(args.advertise_host, args.host, args.interface or None, args.port)
    if watcher.static:  # only addresses given, none usable: no interface can bring one
        raise RingletError("--host 0.0.0.0 needs --advertise-host (no non-loopback IPv4 address found)")
    public = watcher.current.public  # None: started before its network; waited for below (cluster/netwatch.py)
    if not args.interface:
        log_skipped_interfaces()
    api_host = (public or "127.0.0.1") if args.api_host in ("0.0.0.0", "") else args.api_host  # noqa: S104
    model, config = await loop.run_in_executor(None, build_lazy_model, node.config.model, node.config.dtype)
    spec = model_spec_from_model(model, context_tokens=args.context or min(context_tokens, 4096),
                                 name=node.config.model.name, config=config)
    # one step's activations at the widest chunk: kept off the offer, and MLX's cache limit
    node.work_space_bytes = work_space_bytes(config, node.config.chunk_for(1), spec.context_tokens)
    node.tokenizer_bytes = tokenizer_bytes(config)  # built at the first request: planned for from the start
    node.kv_bytes_per_token_per_layer = spec.kv_bytes_per_token_per_layer  # a stage's KV room (engine/kv_room.py)
    node.layer_bytes = spec.layer_bytes  # a re-plan that would not fit beside the old range drops first
    await node.engine.run(set_cache_limit, node.work_space_bytes)
    record = {
        "name": socket.gethostname(), "chip": getattr(probe.machine, "chip", None) or "",
        **memory.fields(),  # what the planner may fill with weights and KV, and which rule set it
        "memory_bandwidth_bytes_per_s": speed.memory_bandwidth_bytes_per_s if speed else None,
        "flops": speed.matmul_flops if speed else None,
        # a model's lane (ops/lanes.py) advertises its node's API, which sends requests to it
        "api_url": getattr(args, "public_api_url", None) or f"http://{api_host}:{args.api_port}", "links": {},
        "thunderbolt": thunderbolt_record(getattr(probe, "thunderbolt", ())),
        "whole_model": getattr(args, "fetched_location", None) is None,  # a tensor rank needs every layer
        "model": node.config.model.ident,  # a Hub model: its commit, which the members agree on
        **versions.record_fields(),  # release, protocol version, capabilities (what a plan may use)
    }
    num_layers = len(spec.layer_bytes)
    tp_spec = await loop.run_in_executor(None, model_tp_spec, node.config.model, node.config.dtype)

    advertise = f"{public or '0.0.0.0'}:{args.port}"  # noqa: S104 - not advertised until it has an address
    membership = Membership(
        identity.node_id, advertise, node.cluster_id, identity.incarnation, node.config.transport,
        heartbeat_s=args.heartbeat_s, suspect_after_s=2 * args.heartbeat_s, remove_after_s=args.remove_after_s,
        on_event=node.event, epoch_fn=lambda: (node.epoch, node.plan.plan_id if node.plan else ""))
    membership.set_record(record)
    negotiator = Negotiator(node, membership, spec, node.config.model.ident, num_layers,
                            Policy(name=args.policy, prefill_share=args.prefill_share), settle_s=args.settle_s,
                            initial_settle_s=args.initial_settle_s, requires=required_by(config))

    def on_change() -> None:
        negotiator.membership_changed()
        membership.links_wanted.set()

    membership.on_change = on_change
    # which of each member's addresses to dial; a route that breaks or speeds up: re-plan
    tb = frozenset(i for p in getattr(probe, "thunderbolt", ()) if (i := getattr(p, "interface", None)))
    router = Router(membership, watcher.current.dial,
                    on_change=negotiator.membership_changed, thunderbolt=tb,
                    refresh_s=getattr(args, "link_refresh_s", LINK_REFRESH_S),
                    api_port=args.api_port if args.api_host in ("0.0.0.0", "") else None)  # noqa: S104 - comparison
    router.publish()

    def waiting(why: str | None) -> None:  # the node's state says it until it has an address
        node.state = "no-address" if why else "discovering" if node.state == "no-address" else node.state

    # this node's own addresses: waited for at start, followed while it runs (re-advertised, re-dialled)
    follower = NetworkFollower(watcher, membership, router, on_change=negotiator.membership_changed,
                               on_event=node.event, on_waiting=waiting, reconnect=node.reconnect,
                               peers=[f"{h}:{p}" for h, p in parse_peers(args.peers)] if args.peers else [])
    negotiator.network = follower  # /v1/cluster's "network"
    node.cluster = negotiator
    node.tp = tp = TPServing(node, membership, args.mode, tp_spec, str(node.config.model.path), node.config.dtype)
    negotiator.tp = tp
    tp.on_failed = negotiator.membership_changed  # a group that gave up: re-plan (on the pipeline)

    def record_changed(member) -> None:
        tp.record_changed(member)  # another member's group gave up (hybrid plans)
        router.record_changed(member)  # its routes changed: the plan's addresses may move
        memory.record_changed(member)  # its usable memory changed: re-plan

    membership.on_record_changed = record_changed
    if getattr(args, "fetched_location", None) is not None and getattr(args, "hub", None) is None:
        node.config.fetch = _make_fetcher(node, membership, args.fetch_cache_dir)
        for message in getattr(args, "fetch_events", []):
            node.event("fetch", message)
    await membership.start()
    tasks = [asyncio.create_task(router.run(), name="links"), memory.start(membership, negotiator)]

    discovery = None
    if not args.no_mdns:
        async def on_conflict(other) -> None:
            new = identity.regenerate(f"another live node at {list(other.addresses)} holds id {other.node_id} "
                                      "and started earlier (cloned disk?)")
            node.node_id = new
            membership.node_id = new
            node.event("identity", f"took a fresh id {new}: another live node had ours")
            await discovery.set_node_id(new)

        def on_peer(advert) -> None:
            for host in advert.addresses:
                membership.consider(f"{host}:{advert.grpc_port}", advert.node_id)

        def on_goodbye(node_id: str) -> None:
            membership.suspect(node_id, "mDNS goodbye")

        def on_incompatible(peer: tuple[str, list[str]]) -> None:  # its handshake keeps it out, saying why
            for address in peer[1]:
                membership.consider(address, peer[0])

        interfaces = args.interface or None
        discovery = Discovery.for_identity(identity, args.cluster, args.port, args.api_port, interfaces=interfaces,
                                           on_peer=on_peer, on_goodbye=on_goodbye, on_conflict=on_conflict,
                                           on_incompatible=on_incompatible,
                                           secret=node.config.transport.secret)
        follower.discovery = discovery  # started once this node has an address
    for host, port in parse_peers(args.peers) if args.peers else []:
        membership.consider(f"{host}:{port}")
    tasks.append(asyncio.create_task(follower.run(negotiator.start), name="network"))

    async def redial() -> None:
        """Re-dial --peers and members lost in the last minutes, and re-query mDNS while a
        member is lost or suspect (every 2 s) or while this node is alone (every 10 s):
        a peer that comes back after a cut link is found again (mDNS caches alone would
        take ~19 min, and a running browser does not re-query by itself)."""
        rounds = 0
        while True:
            await asyncio.sleep(2.0)
            rounds += 1
            for host, port in parse_peers(args.peers) if args.peers else []:
                membership.consider(f"{host}:{port}")
            lost = membership.redial_lost()
            suspect = any(m.state == "suspect" for m in membership.members.values())
            alone = not membership.members
            if discovery is not None and (lost or suspect or (alone and rounds % 5 == 0)):
                with contextlib.suppress(Exception):
                    await discovery.refresh(timeout=0.5)

    tasks.append(asyncio.create_task(redial(), name="redial"))

    async def stop(leave_by: float | None = None) -> None:
        """Stop the cluster side; with ``leave_by`` (a ``time.monotonic()`` deadline),
        first leave gracefully (:func:`ringlet.daemon.cluster.leave.leave_cluster`)."""
        for t in tasks:
            t.cancel()
        if leave_by is not None:
            from ringlet.daemon.cluster.leave import leave_cluster

            await negotiator.stop()  # no proposals of its own while it leaves
            node.event("leave", "stopping: telling the peers")
            left = await leave_cluster(membership, node.epoch, leave_by)
            log.info("leaving: %s", left.line)
            if left.replanned:
                await node.await_handoff(leave_by)  # the new holders of its layers fetch their KV
        await tp.close()
        await negotiator.stop()
        if discovery is not None:
            with contextlib.suppress(Exception):
                await discovery.stop()
        await membership.stop()
        identity.close()

    return stop


async def _loading_bar(node: Node, stop: asyncio.Event) -> None:
    """A rich progress bar while this node loads a stage (plain runs in a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = None
        while not stop.is_set():
            fraction = node.loading_progress
            download = node.download.to_dict() if node.download is not None else None
            if download is not None:  # the stage's files from the Hub: bytes, rate, ETA
                if task is None:
                    task = bar.add_task("downloading", total=1.0)
                rate, eta = download["rate_bytes_per_s"], download["eta_s"]
                bar.update(task, completed=download["bytes_done"] / max(1, download["bytes_total"]),
                           description=f"downloading {download['what']}: {download['bytes_done'] / 1e6:.0f} of "
                                       f"{download['bytes_total'] / 1e6:.0f} MB"
                                       + (f", {rate / 1e6:.1f} MB/s, ETA {eta:.0f} s" if rate and eta else ""))
            elif fraction is not None:
                spec = node.plan.stages[node.index] if node.plan and node.index is not None else None
                if task is None:
                    task = bar.add_task("loading layers", total=1.0)
                where = f" layers [{spec.start}, {spec.end})" if spec else ""
                bar.update(task, completed=fraction, description=f"loading {node.config.model.name}{where}")
            elif task is not None:
                bar.remove_task(task)
                task = None
            await asyncio.sleep(0.2)


async def serve(args) -> int:
    """Run the daemon until SIGINT/SIGTERM. Returns the exit code."""
    tune_allocator()
    mode = getattr(args, "mode", "auto")
    if args.plan and mode in ("tensor", "hybrid"):
        raise RingletError(f"--mode {mode} needs negotiated plans; drop --plan (a static plan is a pipeline)")
    if getattr(args, "fetch_model", False) and parse_ref(args.model) is None:
        await bootstrap_fetch(args)
    else:  # --model ORG/NAME[@REVISION]: the Hub (with --fetch-model or not), else members
        await resolve_run_model(args, bootstrap_fetch)
    lane_start(args)  # a model's lane of a node serving several: its share, its parent (ops/lanes.py)
    config, context = build_config(args)
    node = Node(config)
    if getattr(args, "lane_supervisor", None):
        config.reserve = lane_reserver(args.lane_supervisor, args.model)
    tokenizer = LazyTokenizer(functools.partial(load_tokenizer, config.model))
    if getattr(args, "draft_model", None):
        node.draft_model = load_draft_model(args.draft_model, config, tokenizer)
    if getattr(args, "hub", None) is not None:  # each stage's files come from the Hub at prepare
        config.fetch = hub_fetcher(node, args.hub)
    threads = ThreadSizer(machine_cache_dir() / PROCS_DIR, getattr(args, "threads", None)).start()
    stop_cluster = None
    # Import what the worker threads import, here, once: two threads importing
    # mlx_lm at the same time can deadlock on the import lock. The API stack (FastAPI,
    # uvicorn) is imported only now, once the options, the plan and the model have been
    # checked, so a bad command line fails at once. The tokenizer (transformers) is built
    # on the first API request that needs it (api/tokenizer.py), or above, to check a
    # --draft-model against it.
    import mlx_lm.models.cache  # noqa: F401
    if config.model.kind != "gguf":  # its stage loads import mlx_lm.utils (and with it transformers)
        import mlx_lm.utils  # noqa: F401
    import uvicorn

    from ringlet.daemon.api.app import create_app
    from ringlet.daemon.ops.draining import DrainingServer
    await node.start()
    if config.plan is None:
        stop_cluster = await _start_cluster(args, node, context)
    app = create_app(node, tokenizer, config.model.name, context, limits=api_limits(args))
    drain_s = float(getattr(args, "drain_timeout_s", DRAIN_TIMEOUT_S))
    server = DrainingServer(uvicorn.Config(app, host=args.api_host, port=args.api_port, log_level="warning",
                                           lifespan="off", access_log=False, timeout_graceful_shutdown=drain_s))
    log.info("node %s: gRPC %s, API http://%s:%d, %s", node.node_id, config.address, args.api_host, args.api_port,
             "static plan" if config.plan is not None else f"cluster {args.cluster!r}")
    started = time.monotonic()
    draw = own_dashboard(args)
    if draw is None and foreground_terminal():  # --no-dashboard in a terminal: a loading bar
        draw = functools.partial(_loading_bar, node)
    try:
        async with drawn(draw):
            await server.serve()
    finally:
        if stop_cluster is not None:
            # the API requests this node served have had their part of the drain (uvicorn
            # waits for them up to drain_s); the leave gets the rest, and 2 s at least
            stopping = server.stopping_at or time.monotonic()
            await stop_cluster(leave_by=max(stopping + drain_s, time.monotonic() + 2.0))
        await node.stop()
        threads.stop()
    log.info("stopped after %.0f s", time.monotonic() - started)
    return 0
