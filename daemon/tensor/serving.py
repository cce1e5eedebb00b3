"""Tensor-parallel serving inside the daemon: the mode decision of a negotiated plan, the
group of a committed tensor plan, and the ranks this node runs for another leader.

How a tensor plan is served
---------------------------
* **Decision** (proposer, :func:`decide_mode`): :func:`tp_config.decide` over the members
  (memory and addresses from their records) and one link per pair (the measured link's
  kind and bandwidth when there is one; every pair of members reaches each other, since
  they heartbeat each other). The decision travels in the proposal (``Proposal.tp_json``)
  and becomes ``ServingPlan.tp``; a tensor plan lists the ranks as its stages, each
  holding every layer.
* **Modes.** ``auto`` keeps the pipeline when members share a machine (loopback links:
  their ranks would split one memory bus and gain nothing). ``--mode tensor`` (or
  ``hybrid``) runs that mode whenever the members can; when they cannot (heads do not
  divide by the group size, no ring, fewer than 4 members for hybrid), the cluster
  serves the pipeline, and ``/v1/cluster`` says the mode was refused and why
  (``tp.refused``): the pipeline stays the fallback, so losing a member of a tensor
  group keeps the cluster serving.
* **Hybrid** (tensor groups chained as pipeline stages): the decision lists the groups
  (``groups``, each in rank order, its leader first) and each group's layer range
  (``layer_ranges``: an even split, :func:`hybrid_layer_ranges`). The plan's stages are
  the group leaders with those ranges; each leader's engine runs a
  :class:`~ringlet.daemon.tensor.group_stage.GroupStage` whose group (ranks started as for a
  tensor plan, but loading only the group's layers) computes the stage, and hidden
  states travel between leaders over the ordinary gRPC ring.
* **Group** (leader = rank 0 = the proposer, :class:`TPServing`): on commit it starts a
  :class:`~ringlet.daemon.tensor.group.TPGroup` whose :class:`ClusterLauncher` starts its own
  rank here and every other rank through that member's daemon (``RunRank``), so each
  rank runs on its own member's machine. The control server binds this node's cluster
  address and takes only connections that present the group epoch's random token.
* **Ranks for another leader** (:meth:`TPServing.run_rank`): only for the committed
  tensor plan naming this node at that rank, led by a member, with the control address
  on the leader's host; only MLX's own variables and host files are accepted. The rank
  lives as long as the call: cancelling it (or the leader vanishing) kills the rank, and
  a rank exits by itself when this daemon dies (its stdin closes).
* **Failure**: the group restarts on the same ranks when every member still answers
  (a rank process crashed; in-flight requests resume inside the group), up to
  ``max_restarts`` times in a row. A member that does not answer fails the group at
  once (it never shrinks by itself): in-flight requests get an error, the API node
  waits for the cluster's re-plan and resumes them on it by re-prefilling (Node.generate).
  A group that gives up (restarts exhausted, or it never started) makes its leader, the
  proposer, re-plan the same members on the pipeline, saying why; a membership change
  tries tensor again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.tensor import planning as tp_config
from ringlet.daemon.tensor.group import LocalRankHandle, TPGroup, TPGroupError, start_rank_process
from ringlet.daemon.tensor.group_stage import GroupStage
from ringlet.daemon.tensor.planning import TPDecision, TPLink, TPMember, TPModelSpec, TPRefused
from ringlet.daemon.tensor.worker import TOKEN_ENV
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan

log = logging.getLogger(__name__)

#: ``--mode`` values.
REQUESTED_MODES = ("auto", "pipeline", "tensor", "hybrid")
#: Modes whose plans run tensor groups.
GROUP_MODES = ("tensor", "hybrid")
#: Environment variable of the daemon: a library preloaded into its rank processes only
#: (tests use MLX's poll shim, tests/tp_support.py, to run more ranks than cores).
PRELOAD_ENV = "RINGLET_TP_LD_PRELOAD"
#: Seconds a member waits for the commit of the plan a RunRank names (the leader starts
#: its group as soon as it committed; the other members commit moments later).
COMMIT_WAIT_S = 10.0
#: Seconds a request waits for the group of a tensor plan committed moments ago to exist
#: (the previous group is closed first); the group's own start is waited for by TPGroup.
GROUP_WAIT_S = 30.0
#: Seconds the leader waits for a member to start its rank process.
RANK_START_TIMEOUT_S = 60.0
#: Variables and host files a leader may set for a rank (MLX's own configuration only).
RANK_ENV_KEYS = frozenset({"MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR"})
RANK_FILES = frozenset({tp_config.HOSTFILE_NAME, tp_config.IBV_DEVICES_NAME})
RANK_DTYPES = frozenset({"float32", "bfloat16", "float16", "model"})


# ---------------------------------------------------------------------------------------- decision


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _links_of(records: Mapping[str, dict], node_id: str) -> dict:
    return (records.get(node_id) or {}).get("links") or {}


#: ThunderboltPort fields a node publishes in its record (``record["thunderbolt"]``): what
#: ``probes.match_links`` needs to pair cables across members, and whether RDMA works.
TB_FIELDS = ("port_id", "interface", "own_domain_uuid", "peer_domain_uuid", "link_speed_bytes_per_s", "peer_rdma")


def thunderbolt_record(ports: Sequence[Any]) -> list[dict]:
    """This node's cabled Thunderbolt ports (``probe.thunderbolt``) for its membership record."""
    return [{f: getattr(p, f, None) for f in TB_FIELDS} for p in ports
            if getattr(p, "own_domain_uuid", None) and getattr(p, "peer_domain_uuid", None)]


def _ports_of(record: Mapping[str, Any]) -> tuple:
    from ringlet.daemon.probes.common import ThunderboltPort

    out = []
    for d in record.get("thunderbolt") or ():
        if not isinstance(d, dict):
            continue
        speed = d.get("link_speed_bytes_per_s")
        out.append(ThunderboltPort(
            port_id=str(d["port_id"]) if d.get("port_id") is not None else None,
            interface=str(d["interface"]) if d.get("interface") else None,
            own_domain_uuid=str(d.get("own_domain_uuid") or "") or None,
            peer_domain_uuid=str(d.get("peer_domain_uuid") or "") or None,
            link_speed_bytes_per_s=int(speed) if isinstance(speed, (int, float)) and speed > 0 else None,
            peer_rdma=d.get("peer_rdma") is True,
        ))
    return tuple(out)


def cluster_inputs(
    ids: Sequence[str], records: Mapping[str, dict], addresses: Mapping[str, str]
) -> tuple[list[TPMember], list[TPLink]]:
    """TPMembers and one TPLink per pair of members, from membership records, plus one
    per Thunderbolt cable both ends published (``record["thunderbolt"]``, with RDMA).

    Link kind and bandwidth come from either end's measured link (``record["links"]``);
    a pair not measured yet is ``loopback`` when both addresses are loopback or equal,
    else ``ethernet``. Latency is left to the kind's default: the measured round trip
    is ringlet's gRPC stack (~1 ms on loopback), not MLX's ring socket (~35 us).
    """
    members = []
    for i in ids:
        rec = records.get(i) or {}
        members.append(
            TPMember(
                node_id=i,
                host=_host(addresses.get(i, "")),
                usable_memory=int(rec.get("usable_memory_bytes") or 0),
                memory_bandwidth=rec.get("memory_bandwidth_bytes_per_s") or None,
            )
        )
    links = []
    for a, b in itertools.combinations(sorted(ids), 2):
        measured = _links_of(records, a).get(b) or _links_of(records, b).get(a)
        ha, hb = _host(addresses.get(a, "")), _host(addresses.get(b, ""))
        if measured and measured.get("kind"):
            kind = str(measured["kind"])
            bandwidth = measured.get("bandwidth_bytes_per_s") or None
        else:
            kind = "loopback" if (_is_loopback(ha) and _is_loopback(hb)) or ha == hb else "ethernet"
            bandwidth = None
        links.append(TPLink(a, b, kind, bandwidth=bandwidth))
    # Thunderbolt cables both ends published (RDMA on both ends makes JACCL possible)
    from ringlet.daemon.probes.links import match_links

    cables = match_links({i: _ports_of(records.get(i) or {}) for i in ids})
    links.extend(tp_config.links_from_thunderbolt(cables))
    return members, links


def _pipeline(requested: str, reason: str, refused: str | None = None) -> dict[str, Any]:
    out = {"mode": "pipeline", "backend": "none", "ranks": [], "reason": reason, "requested": requested}
    if refused:
        out["refused"] = refused
    return out


def decide_mode(
    requested: str,
    ids: Sequence[str],
    records: Mapping[str, dict],
    addresses: Mapping[str, str],
    spec: TPModelSpec,
    leader: str,
) -> dict[str, Any]:
    """The mode decision of a proposal (``TPDecision.to_dict()`` plus ``requested`` and,
    when tensor was asked for but cannot run, ``refused``): see the module docstring.

    Never raises for a cluster that cannot run tensor parallel: the answer is then the
    pipeline, with the reason.
    """
    if requested == "pipeline":
        return _pipeline(requested, "--mode pipeline")
    partial = [i for i in ids if (records.get(i) or {}).get("whole_model") is False]
    if partial and len(ids) > 1:
        why = (f"tensor mode refused: {', '.join(i[:16] for i in partial)} hold(s) only part of the model "
               "(--fetch-model); every rank needs all of it")
        return _pipeline(requested, f"{why}; serving the pipeline", refused=why if requested == "tensor" else None)
    members, links = cluster_inputs(ids, records, addresses)
    try:
        decision = tp_config.decide(members, links, spec, None if requested == "auto" else requested, leader=leader)
    except TPRefused as exc:
        return _pipeline(requested, f"{exc}; serving the pipeline", refused=str(exc))
    except ValueError as exc:  # no members, unknown leader: nothing to decide
        return _pipeline(requested, f"pipeline: {exc}")
    if decision.mode == "pipeline":
        return {**_pipeline(requested, decision.reason), "predicted_s_per_token": dict(decision.predicted)}
    out = {**decision.to_dict(), "requested": requested}
    if decision.mode == "hybrid":
        try:
            out["layer_ranges"] = [list(r) for r in hybrid_layer_ranges(spec.num_layers, len(decision.groups))]
        except ValueError as exc:  # more groups than layers
            why = f"hybrid mode refused: {exc}"
            return _pipeline(requested, f"{why}; serving the pipeline", refused=why)
    if decision.mode in GROUP_MODES and requested == "auto":
        shared = [f"{x.a[:8]}-{x.b[:8]}" for x in links if x.kind == "loopback"]
        if shared:
            return _pipeline(
                requested,
                f"pipeline: members share a machine ({', '.join(shared)} over loopback), where tensor "
                f"ranks would split one memory bus and gain nothing (would have been: {decision.reason}); "
                f"--mode {decision.mode} forces it",
            )
    return out


def hybrid_layer_ranges(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """Half-open layer ranges of ``groups`` chained tensor groups: an even split, the
    earlier groups taking one more layer when it does not divide (the last group also
    runs the output head). E.g. 30 layers, 4 groups: [0, 8), [8, 16), [16, 23), [23, 30).

    Raises:
        ValueError: fewer layers than groups, or no group.
    """
    if groups < 1 or num_layers < groups:
        raise ValueError(f"cannot split {num_layers} layers into {groups} groups")
    base, extra = divmod(num_layers, groups)
    out, start = [], 0
    for i in range(groups):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def group_of(tp: Mapping[str, Any] | None, node_id: str) -> tuple[int, list[str], str, tuple[int, int] | None] | None:
    """The tensor group of a plan's mode decision that ``node_id`` belongs to:
    ``(index, ranks, backend, layer range or None for every layer)``; ``None`` when the
    plan runs no group or the node is in none."""
    if not tp or tp.get("mode") not in GROUP_MODES:
        return None
    if tp["mode"] == "tensor":
        ranks = [str(r) for r in tp["ranks"]]
        return (0, ranks, str(tp["backend"]), None) if node_id in ranks else None
    for i, grp in enumerate(tp["groups"]):
        if node_id in grp:
            a, b = tp["layer_ranges"][i]
            return i, [str(r) for r in grp], str(tp["group_backends"][i]), (int(a), int(b))
    return None


def group_decision(ranks: Sequence[str], backend: str, reason: str) -> TPDecision:
    """The :class:`TPDecision` of one committed group (rank 0 first)."""
    ranks = tuple(str(r) for r in ranks)
    return TPDecision("tensor", backend, ranks, reason, (ranks,), (backend,))


def check_tp_dict(d: Any, member_ids: Sequence[str], proposer: str, num_layers: int | None = None) -> str | None:
    """Why a proposal's mode decision is malformed (``None`` = fine)."""
    if not isinstance(d, dict) or d.get("mode") not in ("pipeline", *GROUP_MODES):
        return "mode decision is not pipeline, tensor or hybrid"
    if d["mode"] == "pipeline":
        return None
    ranks = d.get("ranks")
    if not isinstance(ranks, list) or sorted(map(str, ranks)) != sorted(member_ids):
        return "tensor ranks are not exactly the members"
    if ranks[0] != proposer:
        return "rank 0 of a tensor plan must be its proposer"
    if d["mode"] == "tensor":
        if d.get("backend") not in ("ring", "jaccl"):
            return f"unknown tensor backend {str(d.get('backend'))[:16]!r}"
        return None
    groups, backends, layer_ranges = d.get("groups"), d.get("group_backends"), d.get("layer_ranges")
    if (not isinstance(groups, list) or len(groups) < 2 or not all(isinstance(g, list) and len(g) >= 2 for g in groups)
            or [str(r) for g in groups for r in g] != [str(r) for r in ranks]):
        return "hybrid groups are not the ranks in order, in groups of 2 or more"
    if not isinstance(backends, list) or len(backends) != len(groups) or any(b not in ("ring", "jaccl")
                                                                             for b in backends):
        return "unknown hybrid group backend"
    try:
        bounds = [(int(a), int(b)) for a, b in layer_ranges]
    except (TypeError, ValueError):
        return "hybrid layer ranges are not pairs of integers"
    edges = [0] + [b for _, b in bounds]
    if (len(bounds) != len(groups) or any(a != edges[i] or b <= a for i, (a, b) in enumerate(bounds))
            or (num_layers is not None and edges[-1] != num_layers)):
        return "hybrid layer ranges do not cover every layer exactly once, in order"
    return None


# ---------------------------------------------------------------------------------------- processes


async def spawn_rank(argv: list[str], env: dict[str, str], log_path: Path) -> LocalRankHandle:
    """Start a rank process: own session, output to ``log_path``, stdin a pipe this
    process holds (``--exit-with-stdin``: the rank leaves when this daemon dies)."""
    if "--exit-with-stdin" not in argv:
        argv = [*argv, "--exit-with-stdin"]
    return await start_rank_process(argv, env, log_path, stdin_pipe=True)


def rank_base_env() -> dict[str, str]:
    """This daemon's environment without MLX's variables, plus the rank preload if set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_") and k != TOKEN_ENV}
    preload = os.environ.get(PRELOAD_ENV)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def worker_argv(
    model: str, *, control: str, rank: int, size: int, epoch: int, dtype: str, backend: str,
    hb_interval: float, prefill_chunk: int, side_host: str, layers: tuple[int, int] | None = None,
) -> list[str]:
    """``python -m ringlet.daemon.tensor.worker ...`` for this machine's Python and model
    (``layers``: a hybrid group's half-open layer range; ``None`` = every layer)."""
    argv = [
        sys.executable, "-m", "ringlet.daemon.tensor.worker", "--control", control, "--rank", str(rank),
        "--size", str(size), "--epoch", str(epoch), "--dtype", dtype, "--backend", backend,
        "--hb-interval", str(hb_interval), "--prefill-chunk", str(prefill_chunk), "--side-host", side_host,
        "--model", model, "--exit-with-stdin",
    ]
    if layers is not None:
        argv += ["--layers", f"{layers[0]}:{layers[1]}"]
    return argv


def _argv_options(argv: Sequence[str]) -> dict[str, str]:
    """``--name value`` pairs of a tp_worker command line (flags without a value map to "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a[2:]] = argv[i + 1]
                i += 2
                continue
            out[a[2:]] = ""
        i += 1
    return out


class _RemoteHandle:
    """A rank run by another member's daemon, for as long as its RunRank call lasts."""

    def __init__(self, call, pid: int):
        self.call = call
        self.pid = pid
        self._code: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        code = -int(signal.SIGKILL)
        try:
            while True:  # read(), not async-for: the first event was read() already, and gRPC forbids mixing
                event = await self.call.read()
                if event is grpc.aio.EOF:
                    break
                if event.WhichOneof("event") == "exit_code":
                    code = event.exit_code
                    break
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the member is gone or the call was cancelled: the rank is dead or being killed
        except Exception:  # noqa: BLE001 - whatever went wrong, wait() must return
            log.exception("rank call to a member failed")
        finally:
            if not self._code.done():
                self._code.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._code)

    def kill(self) -> None:
        """Cancel the call: the member kills the rank's process group."""
        self.call.cancel()


class ClusterLauncher:
    """Starts this node's rank here and every other rank on its member's machine (RunRank)."""

    def __init__(self, serving: TPServing, plan_epoch: int):
        self.serving = serving
        self.plan_epoch = plan_epoch

    async def start(self, node_id: str, argv: list[str], env: dict[str, str],
                    log_path: Path) -> LocalRankHandle | _RemoteHandle:
        """Start one rank; raises :class:`TPGroupError` when its member refuses or is unreachable."""
        if node_id == self.serving.node.node_id:
            return await spawn_rank(argv, env, log_path)
        opts = _argv_options(argv)
        directory = str(log_path.parent)
        files, rank_env = {}, {}
        for key, value in env.items():
            if key not in RANK_ENV_KEYS:
                continue
            if value.startswith(directory + os.sep):
                name = Path(value).name
                files[name] = Path(value).read_text()
                value = "{dir}/" + name
            rank_env[key] = value
        request = pb.RankStart(
            leader_id=self.serving.node.node_id, plan_epoch=self.plan_epoch, group_epoch=int(opts["epoch"]),
            rank=int(opts["rank"]), size=int(opts["size"]), backend=opts["backend"], control=opts["control"],
            token=env.get(TOKEN_ENV, ""), dtype=opts["dtype"], hb_interval=float(opts["hb-interval"]),
            prefill_chunk=int(opts["prefill-chunk"]), side_host=opts["side-host"], files=files, env=rank_env,
        )
        if opts.get("layers"):
            request.layer_start, request.layer_end = (int(x) for x in opts["layers"].split(":"))
        address = self.serving.address_of(node_id)
        if not address:
            raise TPGroupError(f"rank {request.rank}: {node_id} is not a member")
        call = self.serving.stub(address).RunRank(request)
        try:
            first = await asyncio.wait_for(call.read(), RANK_START_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            call.cancel()
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
            raise TPGroupError(f"rank {request.rank} on {node_id} did not start: {detail}") from None
        if first is grpc.aio.EOF or first.WhichOneof("event") != "pid":
            call.cancel()
            why = first.error if first is not grpc.aio.EOF and first.WhichOneof("event") == "error" else "no answer"
            raise TPGroupError(f"rank {request.rank} on {node_id} did not start: {why}")
        return _RemoteHandle(call, first.pid)


class _DaemonGroup(TPGroup):
    """A TPGroup that keeps the committed plan's ranks: after a failure it restarts on the
    same members (a rank process that crashed on a live member; in-flight requests resume
    inside the group), but only when every member still answers, and at most
    ``max_restarts`` times in a row. Otherwise it fails, and the cluster's re-plan decides
    what serves next (requests resume on that plan)."""

    def __init__(self, *args: Any, reachable: Callable[[str], Awaitable[bool]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._reachable = reachable

    def _replan(self, lost: set[str], why: str, same_members: bool) -> TPDecision:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return TPDecision("pipeline", "none", (self.leader,),
                              f"{why}; {self.restarts - 1} restarts failed")
        return self._initial

    async def _start_epoch(self, decision: TPDecision):  # -> tp_group._Epoch
        if self._epoch is not None:  # a restart: do not start ranks while a member is gone
            gone = [n for n in decision.ranks if n != self.leader and not await self._reachable(n)]
            if gone:
                raise TPGroupError(f"{self._last_why}; member(s) {', '.join(gone)} do not answer: waiting for "
                                   "the cluster to re-plan")
        return await super()._start_epoch(decision)


# ---------------------------------------------------------------------------------------- serving


class TPServing:
    """Tensor-parallel part of one daemon (see the module docstring).

    Args:
        node: the serving node.
        membership: the member table (addresses, records, stubs).
        requested: ``--mode`` (auto, pipeline, tensor).
        spec: the model as tensor planning sees it.
        model: the model path or name rank processes load (this machine's copy).
        dtype: ``--dtype`` (``None`` = the model's own).
        hb_interval, hb_timeout, step_timeout: the group's health timing (s).
    """

    def __init__(self, node, membership, requested: str, spec: TPModelSpec, model: str, dtype: str | None,
                 *, hb_interval: float = 0.2, hb_timeout: float = 5.0, step_timeout: float = 30.0):
        if requested not in REQUESTED_MODES:
            raise ValueError(f"--mode must be one of {', '.join(REQUESTED_MODES)}")
        self.node = node
        self.membership = membership
        self.requested = requested
        self.spec = spec
        self.model = model
        self.dtype = dtype
        self.hb_interval = hb_interval
        self.hb_timeout = hb_timeout
        self.step_timeout = step_timeout
        self.group: TPGroup | None = None
        self.group_epoch = 0  # the plan epoch self.group serves
        self.group_error = ""
        self._switch_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._ranks: dict[tuple[int, int, int], LocalRankHandle] = {}  # (plan epoch, group epoch, rank) -> rank here
        self._stages: dict[int, GroupStage] = {}  # plan epoch -> the hybrid stage this node leads
        self._workdir = Path(tempfile.mkdtemp(prefix="ringlet-tp-ranks-"))
        self._closed = False
        #: (membership digest, reason) of a tensor group that could not serve: that membership
        #: gets the pipeline (a change of members tries tensor again).
        self.failed: tuple[str, str] | None = None
        #: called when this node's group gives up (the runner starts a negotiation round)
        self.on_failed = None

    # --- helpers ---------------------------------------------------------------------------

    def address_of(self, node_id: str) -> str | None:
        return self.membership.address_of(node_id)

    def stub(self, address: str) -> pb_grpc.RingStub:
        return self.membership.stub(address)

    async def _reachable(self, node_id: str, timeout_s: float = 1.0) -> bool:
        """The member's daemon is in the member table and answers an Echo within ``timeout_s``."""
        member = self.membership.members.get(node_id)
        if member is None or getattr(member, "state", "alive") not in ("alive", "self"):
            return False
        try:
            await self.stub(member.address).Echo(pb.Ping(echo=True), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return True

    def decide(self, ids: Sequence[str]) -> dict[str, Any]:
        """The proposer's mode decision for members ``ids`` (this node leads)."""
        records = {i: self.membership.record_of(i) or {} for i in ids}
        addresses = {i: self.membership.address_of(i) or "" for i in ids}
        out = decide_mode(self.requested, ids, records, addresses, self.spec, self.node.node_id)
        if out["mode"] in GROUP_MODES and self.failed is not None and self.failed[0] == self.membership.digest():
            why = self.failed[1][:500]
            return _pipeline(self.requested, f"{why}; serving the pipeline", refused=why)
        return out

    def group_stage(self, plan: ServingPlan, index: int) -> GroupStage:
        """The engine's stage for stage ``index`` of a hybrid ``plan`` (this node leads
        that stage's group); its group is attached when the plan is committed."""
        spec = plan.stages[index]
        found = group_of(plan.tp, self.node.node_id)
        if found is None or found[1][0] != self.node.node_id or found[3] != (spec.start, spec.end):
            raise TPGroupError(f"epoch {plan.epoch}: this node does not lead the group of layers "
                               f"[{spec.start}, {spec.end})")
        config = {"hidden_size": self.spec.hidden_size, "vocab_size": self.spec.vocab_size}
        stage = GroupStage(spec.start, spec.end, self.spec.num_layers, config, asyncio.get_running_loop(),
                           step_timeout_s=self.step_timeout)
        self._stages[plan.epoch] = stage
        return stage

    # --- commit: start / stop the group ---------------------------------------------------

    def committed(self, plan: ServingPlan) -> None:
        """Called after this node committed ``plan``: stop what belongs to older plans and,
        when this node is rank 0 of a tensor plan, start its group (in the background)."""
        for key, handle in list(self._ranks.items()):
            if key[0] < plan.epoch:
                handle.kill()
        if self.failed is not None and self.failed[0] != self.membership.digest():
            self.failed = None  # other members now: tensor may work again
        own = self.membership.own_record
        if "tp_failed" in own and own["tp_failed"].get("epoch") != plan.epoch and (
                own["tp_failed"].get("digest") != self.membership.digest()):
            self.membership.set_record({k: v for k, v in own.items() if k != "tp_failed"})
        task = asyncio.create_task(self._switch(plan), name=f"tp-switch-{plan.epoch}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _switch(self, plan: ServingPlan) -> None:
        async with self._switch_lock:
            if self.group is not None:
                old, self.group = self.group, None
                await old.close()
            for epoch in [e for e in self._stages if e < plan.epoch]:
                self._stages.pop(epoch).attach(None)  # steps still waiting for that group fail
            self.group_error = ""
            found = group_of(plan.tp, self.node.node_id)
            if self._closed or found is None or found[1][0] != self.node.node_id:
                return
            if self.node.plan is not plan:
                return  # already superseded
            _, ranks, backend, layers = found
            decision = group_decision(ranks, backend, str(plan.tp.get("reason", "")))
            addresses = {i: self.address_of(i) or "" for i in ranks}
            addresses.update({s.node_id: s.address for s in plan.stages})
            records = {i: self.membership.record_of(i) or {} for i in decision.ranks}
            members, links = cluster_inputs(decision.ranks, records, addresses)
            group = _DaemonGroup(
                self.model, members, links, reachable=self._reachable, leader=self.node.node_id, mode="tensor",
                dtype=self.dtype,
                spec=self.spec, fallback="none", launcher=ClusterLauncher(self, plan.epoch),
                control_host=_host(addresses[self.node.node_id]), hb_interval=self.hb_interval,
                hb_timeout=self.hb_timeout, step_timeout=self.step_timeout, decision=decision,
                extra_env={"LD_PRELOAD": os.environ[PRELOAD_ENV]} if os.environ.get(PRELOAD_ENV) else None,
                layers=layers,
            )
            self.group, self.group_epoch = group, plan.epoch
            what = f"layers [{layers[0]}, {layers[1]})" if layers else "every layer"
            self.node.event("tensor", f"epoch {plan.epoch}: starting a {len(decision.ranks)}-rank group over "
                                      f"{decision.backend} ({what})")
        try:
            await group.start()
        except (TPGroupError, TPRefused, OSError) as exc:
            self.group_error = str(exc)
            self.node.event("error", f"tensor group of epoch {plan.epoch} did not start: {exc}")
            log.error("tensor group of epoch %d did not start: %s", plan.epoch, exc)
            stage = self._stages.get(plan.epoch)
            if stage is not None:
                stage.attach(None)
            await self._given_up(plan, f"tensor group did not start: {exc}")
            return
        stage = self._stages.get(plan.epoch)
        if stage is not None:
            stage.attach(group)
        self.node.event("tensor", f"epoch {plan.epoch}: group ready, ranks "
                                  f"{', '.join(r[:8] for r in decision.ranks)}")
        while group is self.group and group.state not in ("failed", "closed"):
            await asyncio.sleep(0.25)
        if group is self.group and group.state == "failed":
            self.group_error = group.reason
            await self._given_up(plan, f"tensor group failed: {group.reason}")

    async def _given_up(self, plan: ServingPlan, why: str) -> None:
        """The group of ``plan`` cannot serve: while the membership stays the same, the
        proposer decides pipeline with the reason, and a negotiation round starts. A group
        leader that is not the proposer (a later stage of a hybrid plan) says so in its
        membership record (``tp_failed``), which the proposer reads (:meth:`record_changed`).
        Not when a member does not answer: its removal re-plans anyway."""
        if self.node.plan is not plan or self._closed:
            return
        for node_id in plan.tp["ranks"]:
            if node_id != self.node.node_id and not await self._reachable(node_id):
                return
        if self.node.plan is not plan:
            return
        digest = self.membership.digest()
        self.failed = (digest, why)
        self.node.event("mode", f"{why[:300]}; re-planning on the pipeline")
        if plan.tp["ranks"][0] != self.node.node_id:
            record = dict(self.membership.own_record)
            record["tp_failed"] = {"digest": digest, "epoch": plan.epoch, "why": why[:500]}
            self.membership.set_record(record)
        elif self.on_failed is not None:
            self.on_failed()

    def record_changed(self, member) -> None:
        """A member's record changed: when it says that member's group of the committed plan
        gave up (same membership), the proposer re-plans on the pipeline, saying why."""
        failed = (member.record or {}).get("tp_failed")
        plan = self.node.plan
        if (not isinstance(failed, dict) or plan is None or group_of(plan.tp, member.node_id) is None
                or plan.tp["ranks"][0] != self.node.node_id or failed.get("epoch") != plan.epoch
                or failed.get("digest") != self.membership.digest()):
            return
        why = f"{member.node_id[:8]}: {str(failed.get('why', ''))[:400]}"
        if self.failed == (failed["digest"], why):
            return
        self.failed = (failed["digest"], why)
        self.node.event("mode", f"{why[:300]}; re-planning on the pipeline")
        if self.on_failed is not None:
            self.on_failed()

    # --- generation on rank 0 ----------------------------------------------------------------

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int]) -> AsyncIterator[int]:
        """Tokens of one request driven by this node's group (this node is rank 0).

        Raises:
            GenerationError: no group here for the committed plan, or the group failed.
        """
        plan = self.node.plan
        deadline = time.monotonic() + GROUP_WAIT_S
        while (plan is not None and plan is self.node.plan and self.group_epoch != plan.epoch and not self._closed
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # committed moments ago: the group is being set up
        group = self.group
        if group is None or plan is None or self.group_epoch != plan.epoch:
            why = f": {self.group_error}" if self.group_error else ""
            raise GenerationError(f"this node runs no tensor group for epoch {self.node.epoch}{why}")
        started = time.perf_counter()
        ttft = None
        count = 0
        self.node.state = "serving"
        try:
            async for token in group.generate(prompt, max_tokens, sampling, sorted(stop_ids)):
                if ttft is None:
                    ttft = time.perf_counter() - started
                count += 1
                self.node.tokens_generated_total += 1
                times = getattr(self.node, "_token_times", None)  # the node's tokens/s window (batched decode)
                if times is not None:
                    times.append(time.monotonic())
                yield token
                if token in stop_ids:
                    return
        except TPGroupError as exc:
            raise GenerationError(f"tensor group: {exc}") from None
        finally:
            elapsed = time.perf_counter() - started
            self.node.requests_served += 1
            self.node.recent.append({
                "request_id": request_id, "prompt_tokens": len(prompt), "completion_tokens": count, "ttft_s": ttft,
                "tokens_per_s": (count - 1) / (elapsed - ttft) if ttft is not None and count > 1 and elapsed > ttft
                else None,
            })
            if self.node.state == "serving" and not group.info()["in_flight"]:
                self.node.state = "ready"

    # --- ranks for another leader -------------------------------------------------------------

    async def _check_rank(self, req: pb.RankStart) -> str | None:
        """Why this node must not run the rank ``req`` asks for (``None`` = run it)."""
        deadline = time.monotonic() + COMMIT_WAIT_S
        while self.node.epoch < req.plan_epoch and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        plan = self.node.plan
        if plan is None or plan.epoch != req.plan_epoch:
            return f"this node serves epoch {self.node.epoch}, not {req.plan_epoch}"
        found = group_of(plan.tp, self.node.node_id)
        if found is None:
            return f"epoch {plan.epoch} is not a tensor plan"
        _, ranks, _, layers = found
        if req.leader_id != ranks[0] or req.leader_id not in self.membership.members:
            return "the caller does not lead this plan's tensor group"
        if req.size != len(ranks) or req.rank >= len(ranks) or ranks[req.rank] != self.node.node_id:
            return f"this node is not rank {req.rank} of {req.size}"
        if (req.layer_start, req.layer_end) != (layers or (0, 0)):
            return "the layer range is not this group's"
        leader_host = _host(self.membership.address_of(req.leader_id) or "")
        if _host(req.control) != leader_host or not req.control.rsplit(":", 1)[-1].isdigit():
            return "the control address is not on the leader's host"
        if req.backend not in ("ring", "jaccl") or req.dtype not in RANK_DTYPES:
            return "unknown backend or dtype"
        if set(req.env) - RANK_ENV_KEYS or set(req.files) - RANK_FILES or not req.token:
            return "only MLX's own variables and host files may be set"
        if not 0 < req.hb_interval <= 10 or not 0 < req.prefill_chunk <= 1 << 16:
            return "bad health or prefill settings"
        return None

    async def run_rank(self, req: pb.RankStart, context) -> AsyncIterator[pb.RankEvent]:
        """The RunRank RPC: start the rank, report its pid, then its exit; cancelling the
        call kills it."""
        why = await self._check_rank(req)
        if why is not None or self._closed:
            log.warning("refused to run tensor rank %d for %s: %s", req.rank, req.leader_id[:16], why or "closing")
            yield pb.RankEvent(error=why or "this node is shutting down")
            return
        key = (req.plan_epoch, req.group_epoch, req.rank)
        directory = self._workdir / f"epoch-{req.plan_epoch}-group-{req.group_epoch}"
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in req.files.items():
            (directory / name).write_text(text)
        env = rank_base_env()
        env.update({k: v.replace("{dir}", str(directory)) for k, v in req.env.items()})
        env[TOKEN_ENV] = req.token
        argv = worker_argv(self.model, control=req.control, rank=req.rank, size=req.size, epoch=req.group_epoch,
                           dtype=req.dtype, backend=req.backend, hb_interval=req.hb_interval,
                           prefill_chunk=req.prefill_chunk, side_host=req.side_host,
                           layers=(req.layer_start, req.layer_end) if req.layer_end else None)
        handle = await spawn_rank(argv, env, directory / f"rank-{req.rank}.log")
        self._ranks[key] = handle
        self.node.event("tensor", f"epoch {req.plan_epoch}: running rank {req.rank}/{req.size} for "
                                  f"{req.leader_id[:8]} (pid {handle.pid})")
        try:
            yield pb.RankEvent(pid=handle.pid)
            code = await handle.wait()
            yield pb.RankEvent(exit_code=code)
        finally:
            handle.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(handle.wait()), 10)
            self._ranks.pop(key, None)

    # --- introspection / shutdown ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """``tp`` of ``/v1/cluster``: the committed decision, and the group when this node leads it."""
        plan = self.node.plan
        out: dict[str, Any] = {"requested": self.requested}
        if plan is not None and plan.tp:
            out.update({k: plan.tp.get(k) for k in ("mode", "backend", "ranks", "reason", "refused", "groups",
                                                    "group_backends", "layer_ranges") if k in plan.tp})
        else:
            out.update({"mode": "pipeline", "backend": "none", "ranks": []})
        if self.group is not None:
            g = self.group.info()
            out["group"] = {k: g[k] for k in ("state", "epoch", "size", "backend", "ranks", "reason", "restarts",
                                              "in_flight", "layers")}
            out["group"]["plan_epoch"] = self.group_epoch
        elif self.group_error:
            out["group"] = {"state": "failed", "reason": self.group_error}
        local = [{"plan_epoch": k[0], "group_epoch": k[1], "rank": k[2], "pid": h.pid}
                 for k, h in sorted(self._ranks.items())]
        if self.group is not None and self.group.rank_pids().get(0):
            g = self.group.info()
            local.insert(0, {"plan_epoch": self.group_epoch, "group_epoch": g["epoch"], "rank": 0,
                             "pid": self.group.rank_pids()[0]})
        for r in local:  # what the rank processes on this machine hold (the daemon's own RSS excludes them)
            try:
                r["rss_bytes"] = psutil.Process(r["pid"]).memory_info().rss
            except psutil.Error:
                r["rss_bytes"] = None
        out["local_ranks"] = local
        return out

    async def close(self) -> None:
        """Stop the group and every rank this node runs."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.group is not None:
            with contextlib.suppress(Exception):
                await self.group.close()
            self.group = None
        for handle in list(self._ranks.values()):
            handle.kill()
        for handle in list(self._ranks.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(handle.wait()), 5)
        shutil.rmtree(self._workdir, ignore_errors=True)


def tp_json(d: Mapping[str, Any] | None) -> str:
    """The wire form of a mode decision."""
    return json.dumps(dict(d), sort_keys=True) if d else ""
