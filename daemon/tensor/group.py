"""Supervisor of a tensor-parallel group: start the ranks, watch them, recover, serve.

:class:`TPGroup` owns one tensor group (``mode == "tensor"``, every member holds
every layer split by ``model.shard``). It

* plans with :func:`ringlet.daemon.tensor.planning.decide` (``--mode`` override kept),
* writes MLX's host configuration (:func:`tp_config.host_config`) into an epoch
  directory and starts one :mod:`ringlet.daemon.tensor.worker` process per rank
  (through a :class:`RankLauncher`; :class:`LocalLauncher` starts them on this
  machine, each in its own process group),
* takes every rank's control connection on a loopback TCP server, releases the
  MLX group only once every rank has loaded the model (``init``), and watches
  it: a rank process that exits, a closed control connection, a heartbeat that
  stops for ``hb_timeout`` or a step that runs longer than ``step_timeout`` (a
  ring collective whose peer died never returns -- mlx issue #3862) all fail the
  group,
* on failure kills every rank (SIGKILL to each process group), drops the lost
  members, re-plans tensor mode on the survivors -- or falls back to one process
  on the leader when the heads do not divide (``fallback="single"``) -- starts a
  new epoch and resumes each in-flight request by re-prefilling prompt + tokens
  so far (same seed, random key advanced past the tokens already drawn), so the
  caller's stream continues where it was; greedy output equals an undisturbed run.

The leader (rank 0's member) is this node: losing its rank process restarts the
group on the same members (up to ``max_restarts`` times in a row, then one
process).

Stage mode (``layers=(start, end)``, a hybrid plan's group): the ranks hold only that
layer range and :meth:`TPGroup.stage_forward` runs one forward of it -- token ids or
hidden states in, hidden states or the last position's logits out -- for a KV-cache
slot the caller names (or one batched decode step of several slots). The caller
(:mod:`ringlet.daemon.tensor.group_stage`) keeps sampling and the ring; a restart loses the
slots' caches, which :class:`TPStageLost` reports.

Public API (asyncio)::

    group = TPGroup.local(model, ranks=3, dtype="float32")   # or TPGroup(model, members, links, ...)
    decision = await group.start()
    async for token_id in group.generate(prompt_ids, max_tokens, sampling, stop_ids): ...
    group.info()     # {"mode", "backend", "ranks", "size", "epoch", "state", "reason", ...}
    await group.close()
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.errors import RingletError
from ringlet.daemon.tensor import planning as tp_config
from ringlet.daemon.tensor.planning import TPDecision, TPLink, TPMember, TPModelSpec, TPRefused
from ringlet.daemon.tensor.worker import MAX_FRAME, TOKEN_ENV, encode_message

log = logging.getLogger("ringlet.daemon.tensor.group")


#: Seconds between the first failure signal and the teardown, to learn which member was lost.
FAILURE_GRACE = 0.3
#: An epoch that served this many seconds before failing resets the restart count.
STABLE_AFTER = 60.0


class TPGroupError(RingletError):
    """The tensor group cannot serve (could not start, or every recovery failed)."""


class TPStageLost(TPGroupError):
    """Stage mode: the group restarted since a KV-cache slot was created, so the slot's
    cache is gone (the request must prefill again)."""


# ---------------------------------------------------------------------------------------- model spec


def model_tp_spec(location, dtype: str | None = "float32") -> TPModelSpec:
    """Head counts and bytes of a model for :func:`tp_config.decide`, without reading weights."""
    from ringlet.daemon.engine.modelspec import model_spec_from_model
    from ringlet.daemon.engine.stage import build_lazy_model

    model, config = build_lazy_model(location, dtype)
    ms = model_spec_from_model(model, context_tokens=1, name=location.name, config=config)
    total = sum(ms.layer_bytes) + ms.embedding_bytes + ms.head_bytes
    quant = config.get("quantization")
    spec = tp_config.tp_spec_from_config(
        config,
        total,
        ms.embedding_bytes + ms.head_bytes,
        shardable=callable(getattr(model, "shard", None)),
        activation_itemsize=4 if dtype in (None, "float32") else 2,
        name=location.name,
    )
    if quant is None and location.kind == "gguf" and dtype is None:
        from ringlet.daemon.engine import gguf as gguf_source

        spec = tp_config.TPModelSpec(**{**spec.__dict__, "quant_group_size": gguf_source.GROUP})
    return spec


# ---------------------------------------------------------------------------------------- launching


class RankHandle(Protocol):
    pid: int

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class RankLauncher(Protocol):
    async def start(self, node_id: str, argv: list[str], env: dict[str, str], log_path: Path) -> RankHandle: ...


class LocalRankHandle:
    """A rank process started on this machine (its own session and process group)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.pid = proc.pid

    async def wait(self) -> int:
        code = await self.proc.wait()
        if self.proc.stdin is not None:  # a rank that watches its stdin pipe (--exit-with-stdin)
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        return code

    def kill(self) -> None:
        """SIGKILL the rank's whole process group (it leads its own session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class LocalLauncher:
    """Starts every rank on this machine (ranks of one group simulated on loopback, or
    this node's own rank). Each rank gets its own session/process group."""

    async def start(self, node_id: str, argv: list[str], env: dict[str, str], log_path: Path) -> RankHandle:
        return await start_rank_process(argv, env, log_path)


async def start_rank_process(argv: list[str], env: dict[str, str], log_path: Path,
                             stdin_pipe: bool = False) -> LocalRankHandle:
    """Start one rank process here in its own session, output appended to ``log_path``;
    stdin is a pipe this process holds when ``stdin_pipe``, else /dev/null."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    return LocalRankHandle(proc)


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A base port such that ``base .. base+n-1`` can all be bound on ``host`` right now."""
    for _ in range(tries):
        base = 20000 + secrets.randbelow(40000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise TPGroupError(f"no block of {n} free ports on {host}")


# ---------------------------------------------------------------------------------------- state


@dataclass
class _Req:
    id: str
    kind: str  # gen | logits | bench
    prompt: list[int]
    max_tokens: int = 0
    sampling: dict = field(default_factory=dict)
    stop: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    data: bytes | None = None  # stage mode: the hidden states attached to the request
    generated: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_epoch: int = -1
    done: bool = False
    resumes: int = 0


@dataclass
class _RankState:
    rank: int
    node_id: str
    handle: RankHandle | None = None
    writer: asyncio.StreamWriter | None = None
    last_hb: float = 0.0
    step: int = 0
    busy_for: float = 0.0
    phase: str = "starting"
    loaded: bool = False
    ready: bool = False
    exit_code: int | None = None
    gave_up: bool = False  # sent "fatal" and exits on its own
    side_port: int | None = None  # rank 0: where the others connect their side channel
    fatal: str = ""
    fatal_phase: str = ""
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # its control connection is closed and drained


@dataclass
class _Epoch:
    number: int
    decision: TPDecision
    size: int
    backend: str
    token: str
    directory: Path
    ranks: list[_RankState]
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    all_loaded: asyncio.Event = field(default_factory=asyncio.Event)
    all_ready: asyncio.Event = field(default_factory=asyncio.Event)
    lost: set[str] = field(default_factory=set)
    why: str = ""
    started_at: float = field(default_factory=time.monotonic)
    tasks: list[asyncio.Task] = field(default_factory=list)
    torn: bool = False  # being torn down: exits and EOFs from now on are ours
    launching: list = field(default_factory=list)  # (rank state, launcher task)
    host_config: tp_config.HostConfig | None = None


class TPGroup:
    """A supervised tensor-parallel group serving generation requests.

    Args:
        model: ``--model`` (path or short name; ``None`` = the default model).
        members: candidate members; ``leader`` (default: the first) is this node.
        links: links between members (:mod:`tp_config` helpers).
        mode: ``"tensor"`` (default: refuse with :class:`TPRefused` when impossible)
            or ``None``/``"auto"`` (decide; a non-tensor decision runs one process
            when ``fallback == "single"``).
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` / ``None`` (model's own).
        spec: the model's :class:`TPModelSpec` (default: read from the model).
        fallback: ``"single"`` runs one process on the leader when tensor mode is no
            longer possible; ``"none"`` fails requests instead (the daemon then
            re-plans a pipeline and resumes them itself).
        launcher: how rank processes start (default :class:`LocalLauncher`).
        hb_interval, hb_timeout, step_timeout, start_timeout: health timing (s).
        max_restarts: consecutive restarts on the same members before one process (and of
            that one process before giving up).
        max_resumes: times one request is resumed before it fails on its own (a request
            that crashes the ranks must not take the group down in a loop).
        decision: a tensor decision made already (the daemon's negotiated plan): used as
            the first epoch's ranks instead of deciding again.
        layers: stage mode (a hybrid plan's group): the ranks hold only this half-open
            layer range ``(start, end)`` and serve :meth:`stage_forward`; ``None`` = the
            whole model, served by :meth:`generate`.
    """

    def __init__(
        self,
        model: str | None,
        members: Sequence[TPMember],
        links: Sequence[TPLink],
        *,
        leader: str | None = None,
        mode: str | None = "tensor",
        dtype: str | None = "float32",
        spec: TPModelSpec | None = None,
        fallback: str = "single",
        launcher: RankLauncher | None = None,
        workdir: str | Path | None = None,
        control_host: str = "127.0.0.1",
        python: str = sys.executable,
        hb_interval: float = 0.2,
        hb_timeout: float = 5.0,
        step_timeout: float = 30.0,
        start_timeout: float = 180.0,
        max_restarts: int = 2,
        max_resumes: int = 3,
        prefill_chunk: int = 512,
        extra_env: Mapping[str, str] | None = None,
        decision: TPDecision | None = None,
        layers: tuple[int, int] | None = None,
    ):
        if fallback not in ("single", "none"):
            raise ValueError("fallback must be 'single' or 'none'")
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise ValueError(f"layers must be a non-empty range (start, end), got {layers}")
        self.model = model
        self.members = list(members)
        self.alive = list(members)
        self.links = list(links)
        self.leader = leader or self.members[0].node_id
        self.mode = mode
        self.dtype = dtype
        self.spec = spec
        self.fallback = fallback
        self.launcher = launcher or LocalLauncher()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ringlet-tp-"))
        self.control_host = control_host
        self.python = python
        self.hb_interval = hb_interval
        self.hb_timeout = hb_timeout
        self.step_timeout = step_timeout
        self.start_timeout = start_timeout
        self.max_restarts = max_restarts
        self.max_resumes = max_resumes
        self.prefill_chunk = prefill_chunk
        self.extra_env = dict(extra_env or {})
        self._initial = decision
        self.layers = layers

        self.decision: TPDecision | None = None
        self.state = "new"
        self.reason = ""
        self.restarts = 0
        self.history: list[dict] = []
        self._epoch: _Epoch | None = None
        self._epochs = itertools.count(1)
        self._reqs: dict[str, _Req] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._port = 0
        self._manager: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._closing = False
        self._fatal: BaseException | None = None
        self._last_why = ""

    @classmethod
    def local(cls, model: str | None, ranks: int, *, memory: int = 64 << 30, **kw: Any) -> TPGroup:
        """``ranks`` simulated members on 127.0.0.1 (``rank0``..), loopback links, this machine."""
        members = [TPMember(f"rank{i}", "127.0.0.1", memory) for i in range(ranks)]
        return cls(model, members, tp_config.loopback_links([m.node_id for m in members]), **kw)

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> TPDecision:
        """Plan, start the ranks and wait until the group serves.

        Raises:
            TPRefused: ``mode="tensor"`` and tensor parallelism cannot run here.
            TPGroupError: the group did not come up.
        """
        if self.spec is None:
            from ringlet.daemon.engine.sources import resolve

            loop = asyncio.get_running_loop()
            self.spec = await loop.run_in_executor(None, model_tp_spec, resolve(self.model), self.dtype)
        decision = self._initial or tp_config.decide(self.alive, self.links, self.spec, self.mode, leader=self.leader)
        if decision.mode != "tensor":
            if self.fallback != "single":
                raise TPGroupError(f"not a tensor plan: {decision.reason}")
            decision = self._single(decision.reason)
        self._server = await asyncio.start_server(self._on_connect, self.control_host, 0)
        self._port = self._server.sockets[0].getsockname()[1]
        self._manager = asyncio.create_task(self._manage(decision))
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait({ready, self._manager}, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            exc = self._fatal or (self._manager.exception() if self._manager.done() else None)
            await self.close()
            raise TPGroupError(f"tensor group did not start: {exc}")
        return self.decision

    async def close(self) -> None:
        """Stop every rank (shutdown, then SIGKILL after 1 s) and the control server."""
        self._closing = True
        if self._manager is not None and not self._manager.done():
            self._manager.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._manager
        if self._epoch is not None:
            await self._teardown(self._epoch, graceful=True)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for req in list(self._reqs.values()):
            if not req.done:
                req.queue.put_nowait(("error", "tensor group closed"))
        self.state = "closed"
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def __aenter__(self) -> TPGroup:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------ API

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] = (),
    ) -> AsyncIterator[int]:
        """Token ids as rank 0 produces them; survives group failures (re-prefill).
        Stops after ``max_tokens`` or a token in ``stop_ids`` (which is yielded).

        Raises:
            TPGroupError: the group failed for good.
        """
        sampling = sampling or SamplingParams()
        seed = sampling.seed if sampling.seed is not None else secrets.randbelow(2**31 - 1)
        req = _Req(
            id=f"r{next(self._ids)}",
            kind="gen",
            prompt=[int(t) for t in prompt_ids],
            max_tokens=int(max_tokens),
            sampling={
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "seed": seed,
            },
            stop=[int(t) for t in stop_ids],
            extra={"steps_done": int(sampling.steps_done)},
        )
        async for item in self._run(req):
            yield item

    async def logits(self, prompt_ids: Sequence[int]):
        """Logits ``(tokens, vocab)`` float32 (numpy) of one forward pass over ``prompt_ids``."""
        import numpy as np

        req = _Req(id=f"l{next(self._ids)}", kind="logits", prompt=[int(t) for t in prompt_ids])
        shape, data = await self._one(req)
        return np.frombuffer(data, dtype=np.float32).reshape(shape)

    async def allreduce_seconds(self, width: int | None = None, iters: int = 200) -> float:
        """Seconds per ``all_sum`` of one ``(1, 1, width)`` float32 vector in the current group
        (default width: the hidden size; 0.0 with one process)."""
        width = width or (self.spec.hidden_size if self.spec else 1) or 1
        req = _Req(id=f"b{next(self._ids)}", kind="bench", prompt=[], extra={"iters": iters, "width": width})
        return float(await self._one(req))

    async def stage_forward(self, slot: int | Sequence[int], epoch: int | None, *,
                            tokens: Sequence[int] | None = None, hidden=None, dtype: str = "float32",
                            head: bool = True) -> tuple[int, Any, str]:
        """Stage mode: one forward of this group's layer range for one KV-cache slot, or one
        batched decode step of several.

        Args:
            slot: the request's cache slot (any int the caller keeps unique), or a list of
                ``n`` slots for a batched decode step (one token each; their caches exist).
            epoch: the group epoch the slot's (slots') cache was created in, ``None`` to
                create it now (the first prefill chunk of one slot).
            tokens: token ids (first stage: the chunk's, or one per slot), or
            hidden: hidden states, float32 numpy ``(1, tokens, hidden_size)`` (``(n, 1,
                hidden_size)`` for a batch), whose activation dtype is ``dtype`` (float32,
                float16 or bfloat16).
            head: on the last stage, compute the logits (``False``: a prefill chunk that
                only fills the cache).

        Returns:
            ``(epoch, out, dtype)``: the group epoch that ran it; float32 numpy hidden
            states ``(1, tokens, hidden_size)``, or the last position's logits
            ``(1, 1, vocab)`` on the last stage (``None`` when ``head`` is false; the
            first axis is the slot for a batch); and the activation dtype the ranks
            computed in (``"float32"``, ``"bfloat16"``, ...).

        Raises:
            TPStageLost: the group restarted since ``epoch`` (the slot's cache is gone).
            TPGroupError: the group failed or closed, or the rank refused the step.
        """
        import numpy as np

        if self.layers is None:
            raise TPGroupError("stage_forward needs a group started with layers=(start, end)")
        if isinstance(slot, int):
            extra: dict[str, Any] = {"slot": int(slot), "new": epoch is None, "head": bool(head), "epoch": epoch}
        else:
            if epoch is None:
                raise ValueError("a batched step needs the slots' group epoch")
            extra = {"slots": [int(x) for x in slot], "head": bool(head), "epoch": epoch}
        data = None
        if hidden is not None:
            data = np.ascontiguousarray(hidden, dtype=np.float32).tobytes()
            extra["dtype"] = dtype
        else:
            extra["tokens"] = [int(t) for t in tokens]
        req = _Req(id=f"s{next(self._ids)}", kind="stage", prompt=[], extra=extra, data=data)
        shape, out, out_dtype = await self._one(req)
        ran = req.sent_epoch
        if shape is None:
            return ran, None, out_dtype
        return ran, np.frombuffer(out, dtype=np.float32).reshape(shape), out_dtype

    def free_slot(self, slot: int, epoch: int) -> None:
        """Stage mode: drop a slot's KV cache on every rank (nothing when ``epoch`` is gone)."""
        ep = self._epoch
        if ep is not None and ep.number == epoch and self.state == "ready" and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "free", "slot": int(slot)})

    def info(self) -> dict[str, Any]:
        """Mode, backend, ranks (node ids in rank order), size, epoch, state, reason, pids, restarts."""
        ep = self._epoch
        d = self.decision
        return {
            "mode": d.mode if d else None,
            "backend": (ep.backend if ep else d.backend) if d else None,
            "ranks": list(d.ranks) if d else [],
            "size": ep.size if ep else 0,
            "epoch": ep.number if ep else 0,
            "state": self.state,
            "reason": self.reason or (d.reason if d else ""),
            "restarts": self.restarts,
            "members": [m.node_id for m in self.alive],
            "pids": {r.rank: r.handle.pid for r in ep.ranks if r.handle} if ep else {},
            "in_flight": sum(not r.done for r in self._reqs.values()),
            "history": list(self.history),
            "layers": list(self.layers) if self.layers else None,
        }

    def rank_pids(self) -> dict[int, int]:
        ep = self._epoch
        return {r.rank: r.handle.pid for r in ep.ranks if r.handle} if ep else {}

    # ------------------------------------------------------------------------------------ requests

    async def _one(self, req: _Req) -> Any:
        async with contextlib.aclosing(self._run(req)) as items:
            async for item in items:
                return item
        raise TPGroupError(f"no answer to {req.kind} request")

    async def _run(self, req: _Req):
        if self.state in ("closed", "failed"):
            raise TPGroupError(f"tensor group is {self.state}: {self.reason}")
        self._reqs[req.id] = req
        try:
            self._send_req(req)
            while True:
                item = await req.queue.get()
                if isinstance(item, tuple) and item and item[0] == "done":
                    return
                if isinstance(item, tuple) and item and item[0] == "error":
                    raise TPGroupError(item[1])
                if isinstance(item, tuple) and item and item[0] == "lost":
                    raise TPStageLost(item[1])
                yield item
                if req.kind != "gen":
                    return
        finally:
            self._reqs.pop(req.id, None)
            if not req.done:
                req.done = True
                self._cancel(req)

    def _send_req(self, req: _Req) -> None:
        ep = self._epoch
        if ep is None or self.state != "ready" or req.done or req.sent_epoch == ep.number:
            return
        if req.kind == "gen" and (
            len(req.generated) >= req.max_tokens or (req.generated and req.generated[-1] in req.stop)
        ):
            req.done = True  # finished just before the failure; only the "done" was lost
            req.queue.put_nowait(("done", "stop" if req.generated and req.generated[-1] in req.stop else "length"))
            return
        msg: dict[str, Any] = {"t": req.kind, "id": req.id}
        if req.kind == "stage":
            e = req.extra
            if req.sent_epoch >= 0 or (e["epoch"] is not None and e["epoch"] != ep.number):
                req.done = True  # the caches of the epoch it belongs to are gone
                req.queue.put_nowait(("lost", f"tensor group restarted (epoch {ep.number}): "
                                              "this request's KV cache is gone"))
                return
            msg.update({k: v for k, v in e.items() if k != "epoch"})
            req.sent_epoch = ep.number
            self._write(ep.ranks[0], msg, req.data)
            return
        if req.kind == "gen":
            msg.update(
                prompt=req.prompt + req.generated,
                max_tokens=req.max_tokens - len(req.generated),
                sampling=req.sampling,
                stop=req.stop,
                skip=len(req.generated) + int(req.extra.get("steps_done", 0)),
            )
        elif req.kind == "logits":
            msg.update(prompt=req.prompt)
        else:
            msg.update(req.extra)
        req.sent_epoch = ep.number
        self._write(ep.ranks[0], msg)

    def _cancel(self, req: _Req) -> None:
        ep = self._epoch
        if req.kind == "stage":
            return  # one step: rank 0 finishes it; the slot is freed by free_slot
        if ep is not None and req.sent_epoch == ep.number and ep.ranks and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "cancel", "id": req.id})

    def _write(self, r: _RankState, msg: dict, data: bytes | None = None) -> None:
        if r.writer is not None and not r.writer.is_closing():
            r.writer.write(encode_message(msg, data))

    # ------------------------------------------------------------------------------------ control server

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rs: _RankState | None = None
        ep: _Epoch | None = None
        try:
            hello = await asyncio.wait_for(self._read_frame(reader), 30)
            ep = self._epoch
            if (
                not isinstance(hello, dict)
                or hello.get("t") != "hello"
                or ep is None
                or not hmac.compare_digest(str(hello.get("token", "")), ep.token)
                or hello.get("epoch") != ep.number
            ):
                writer.close()
                return
            rank = int(hello["rank"])
            if not 0 <= rank < ep.size or ep.ranks[rank].writer is not None:
                writer.close()
                return
            rs = ep.ranks[rank]
            rs.writer = writer
            rs.last_hb = time.monotonic()
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                msg = await self._read_frame(reader)
                if msg is None:
                    break
                self._on_message(ep, rs, msg)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            raise
        finally:
            if rs is not None:
                rs.eof.set()
            if rs is not None and ep is not None and not self._closing:
                lost = set() if rs.gave_up else {rs.node_id}
                self._fail(ep, lost, f"rank {rs.rank} ({rs.node_id}) closed its control connection")
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    async def _read_frame(reader: asyncio.StreamReader) -> Any:
        import json

        try:
            head = await reader.readexactly(4)
        except asyncio.IncompleteReadError:
            return None
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME:
            raise ValueError("control frame too large")
        msg = json.loads(await reader.readexactly(n))
        if isinstance(msg, dict) and msg.get("bin") is not None:  # an attachment: raw bytes
            (m,) = struct.unpack(">I", await reader.readexactly(4))
            if m > MAX_FRAME:
                raise ValueError("control frame too large")
            msg["_data"] = await reader.readexactly(m)
        return msg

    def _on_message(self, ep: _Epoch, rs: _RankState, msg: dict) -> None:
        t = msg.get("t")
        if t == "fatal":
            rs.fatal, rs.fatal_phase, rs.gave_up = str(msg.get("msg")), str(msg.get("phase", "")), True
        if ep is not self._epoch or ep.failed.is_set():
            return  # a failed epoch's late messages are ignored; its tokens so far are kept
        rs.last_hb = time.monotonic()
        if t == "hb":
            rs.step, rs.busy_for, rs.phase = int(msg["step"]), float(msg["busy_for"]), str(msg["phase"])
        elif t == "loaded":
            rs.loaded = True
            rs.side_port = msg.get("side_port")
            if all(r.loaded for r in ep.ranks):
                ep.all_loaded.set()
        elif t == "ready":
            rs.ready = True
            if all(r.ready for r in ep.ranks):
                ep.all_ready.set()
        elif t == "fatal":  # it leaves by itself: not a lost member (often it saw a peer vanish)
            self._fail(ep, set(), f"rank {rs.rank} ({rs.node_id}) failed: {msg.get('msg')}")
        elif t in ("tok", "done", "logits", "bench", "error", "out"):
            req = self._reqs.get(msg.get("id", ""))
            if req is None or req.done:
                return
            if t == "tok":
                for tok in msg["ids"]:
                    req.generated.append(int(tok))
                    req.queue.put_nowait(int(tok))
            elif t == "done":
                req.done = True
                req.queue.put_nowait(("done", msg.get("reason")))
            elif t == "logits":
                req.done = True
                req.queue.put_nowait((tuple(msg["shape"]), base64.b64decode(msg["b64"])))
            elif t == "bench":
                req.done = True
                req.queue.put_nowait(msg["seconds_per_allreduce"])
            elif t == "out":
                req.done = True
                shape = msg.get("shape")
                req.queue.put_nowait((tuple(shape) if shape is not None else None, msg.get("_data"),
                                      str(msg.get("dtype") or "float32")))
            else:
                req.done = True
                req.queue.put_nowait(("error", msg.get("msg", "error")))

    # ------------------------------------------------------------------------------------ failure

    def _fail(self, ep: _Epoch, lost: set[str], why: str) -> None:
        """Mark the epoch failed (the first reason is kept; lost members accumulate, because a
        surviving rank may report a vanished peer before that peer's exit is seen)."""
        if self._closing or ep.torn:
            return
        ep.lost |= lost
        if ep.failed.is_set():
            return
        ep.why = why
        log.warning("tensor group epoch %d failed: %s", ep.number, why)
        ep.failed.set()

    async def _watch_exit(self, ep: _Epoch, rs: _RankState) -> None:
        code = await rs.handle.wait()
        rs.exit_code = code
        if rs.writer is not None:  # read what it said before leaving (a "fatal" changes the verdict)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rs.eof.wait(), 1.0)
        if not self._closing:
            tail = self._log_tail(ep, rs.rank)
            lost = set() if rs.gave_up else {rs.node_id}  # a rank that reported its error left by itself
            self._fail(
                ep, lost, f"rank {rs.rank} ({rs.node_id}) exited with code {code}" + (f": {tail}" if tail else "")
            )

    @staticmethod
    def _log_tail(ep: _Epoch, rank: int) -> str:
        p = ep.directory / f"rank-{rank}.log"
        try:
            lines = [x for x in p.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    async def _monitor(self, ep: _Epoch) -> None:
        while not ep.failed.is_set():
            await asyncio.sleep(self.hb_interval)
            now = time.monotonic()
            if not ep.all_ready.is_set():  # loading may starve the heartbeat thread; the start has its own limit
                if now - ep.started_at > self.start_timeout:
                    missing = [r for r in ep.ranks if not r.ready]
                    self._fail(
                        ep, set(), f"ranks {[r.rank for r in missing]} not ready after {self.start_timeout:.0f} s"
                    )
                    return
                continue
            silent = [r for r in ep.ranks if now - r.last_hb > self.hb_timeout]
            if silent:
                self._fail(
                    ep,
                    {r.node_id for r in silent},
                    f"no heartbeat from rank(s) {', '.join(str(r.rank) for r in silent)} for {self.hb_timeout:.1f} s",
                )
                return
            stuck = [r for r in ep.ranks if r.busy_for > self.step_timeout]
            if stuck:
                self._fail(
                    ep,
                    set(),
                    f"rank(s) {', '.join(str(r.rank) for r in stuck)} stuck in one step for "
                    f"more than {self.step_timeout:.1f} s (a peer is gone or the link is down)",
                )
                return

    async def _teardown(self, ep: _Epoch, graceful: bool = False) -> None:
        ep.torn = True
        for rs, launch in ep.launching:
            if rs.handle is None:
                with contextlib.suppress(Exception):
                    rs.handle = await launch
        if graceful and not ep.failed.is_set():
            for r in ep.ranks:
                self._write(r, {"t": "shutdown"})
            waits = [asyncio.create_task(r.handle.wait()) for r in ep.ranks if r.handle]
            if waits:
                await asyncio.wait(waits, timeout=1.0)
        for r in ep.ranks:
            if r.handle is not None:
                r.handle.kill()
        for r in ep.ranks:
            if r.handle is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(r.handle.wait(), 10)
            if r.writer is not None:
                with contextlib.suppress(Exception):
                    r.writer.close()
        for t in ep.tasks:
            t.cancel()
        for t in ep.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # ------------------------------------------------------------------------------------ epochs

    def _single(self, reason: str) -> TPDecision:
        return TPDecision("pipeline", "none", (self.leader,), f"one process on {self.leader}: {reason}")

    def _replan(self, lost: set[str], why: str, same_members: bool) -> TPDecision:
        if same_members:
            self.restarts += 1
        else:
            self.restarts = 0
        self.alive = [m for m in self.alive if m.node_id not in lost or m.node_id == self.leader]
        if len(self.alive) == 1:
            return self._single(f"{why}; no other member left")
        if self.restarts > self.max_restarts:
            return self._single(f"{why}; {self.restarts - 1} restarts on the same members failed")
        try:
            return tp_config.decide(self.alive, self.links, self.spec, "tensor", leader=self.leader)
        except TPRefused as exc:
            return self._single(f"{why}; {exc}")

    async def _manage(self, decision: TPDecision) -> None:
        try:
            while not self._closing:
                if decision.mode != "tensor" and self.fallback != "single":
                    raise TPGroupError(decision.reason)
                ep = await self._start_epoch(decision)
                ok = await self._wait_ready(ep)
                if ok:
                    self.state = "ready"
                    self.reason = decision.reason
                    self._ready.set()
                    for req in list(self._reqs.values()):
                        if (req.kind != "stage" and not req.done and req.sent_epoch >= 0
                                and req.sent_epoch != ep.number):
                            req.resumes += 1
                            if req.resumes > self.max_resumes:  # it may be what kills the group
                                req.done = True
                                req.queue.put_nowait(
                                    ("error", f"request interrupted {req.resumes} times: {self._last_why}")
                                )
                                continue
                        self._send_req(req)
                    ready_at = time.monotonic()
                    await ep.failed.wait()
                    if time.monotonic() - ready_at > STABLE_AFTER:
                        self.restarts = 0  # it served a good while: count restarts afresh
                self.state = "recovering"
                await asyncio.sleep(FAILURE_GRACE)
                self._last_why = ep.why  # let the other ranks' exits and EOFs name the lost member
                self.history.append(
                    {
                        "epoch": ep.number,
                        "size": ep.size,
                        "ranks": list(ep.decision.ranks),
                        "failed": ep.why,
                        "lost": sorted(ep.lost),
                    }
                )
                await self._teardown(ep)
                if self._closing:
                    return
                load_errors = {r.fatal for r in ep.ranks if r.fatal and r.fatal_phase == "loading"}
                if not ok and load_errors:  # the model itself cannot load: restarting will not help
                    raise TPGroupError(f"rank could not load the model: {sorted(load_errors)[0]}")
                if ep.size == 1:  # nothing to re-plan: start the one process again, a few times
                    self.restarts += 1
                    if self.restarts > self.max_restarts:
                        raise TPGroupError(f"single process failed {self.restarts} times: {ep.why}")
                    decision = ep.decision
                    continue
                lost_others = ep.lost - {self.leader}
                decision = self._replan(ep.lost, ep.why, same_members=not lost_others)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fatal = exc
            self.state = "failed"
            self.reason = str(exc)
            for req in list(self._reqs.values()):
                if not req.done:
                    req.done = True
                    req.queue.put_nowait(("error", f"tensor group failed: {exc}"))
            log.error("tensor group failed: %s", exc)
            ep = self._epoch
            if ep is not None and not ep.torn:  # e.g. a rank of a new epoch could not start: stop the others
                with contextlib.suppress(Exception):
                    await self._teardown(ep)

    async def _wait_ready(self, ep: _Epoch) -> bool:
        """Release the MLX group once every rank loaded; True when all are ready."""
        failed = asyncio.create_task(ep.failed.wait())
        try:
            loaded = asyncio.create_task(ep.all_loaded.wait())
            await asyncio.wait({loaded, failed}, return_when=asyncio.FIRST_COMPLETED)
            loaded.cancel()
            if ep.failed.is_set():
                return False
            for r in ep.ranks:
                self._write(r, {"t": "init", "side": self._side_address(ep)})
            ready = asyncio.create_task(ep.all_ready.wait())
            await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            return not ep.failed.is_set()
        finally:
            failed.cancel()

    def _host(self, node_id: str) -> str:
        return next(m.host for m in self.members if m.node_id == node_id)

    def _side_address(self, ep: _Epoch) -> str | None:
        port = ep.ranks[0].side_port
        return f"{self._host(ep.ranks[0].node_id)}:{port}" if port else None

    async def _start_epoch(self, decision: TPDecision) -> _Epoch:
        self.decision = decision
        number = next(self._epochs)
        size = len(decision.ranks)
        backend = decision.backend if size > 1 else "none"
        directory = self.workdir / f"epoch-{number}"
        directory.mkdir(parents=True, exist_ok=True)
        ep = _Epoch(
            number=number,
            decision=decision,
            size=size,
            backend=backend,
            token=secrets.token_hex(16),
            directory=directory,
            ranks=[_RankState(i, n) for i, n in enumerate(decision.ranks)],
        )
        self._epoch = ep
        self.state = "starting"
        self._ready.clear()
        if size > 1:
            by_id = {m.node_id: m for m in self.alive}
            hosts = {by_id[n].host for n in decision.ranks}
            base = free_port_block(size + 1, next(iter(hosts)) if len(hosts) == 1 else "127.0.0.1")
            ep.host_config = tp_config.host_config(decision.ranks, backend, self.alive, self.links, base_port=base)
            ep.host_config.write(directory)
        for rs in ep.ranks:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
            env.update(self.extra_env)
            if ep.host_config is not None:
                env.update(ep.host_config.env(rs.rank, directory))
            env[TOKEN_ENV] = ep.token
            argv = [
                self.python,
                "-m",
                "ringlet.daemon.tensor.worker",
                "--control",
                f"{self.control_host}:{self._port}",
                "--rank",
                str(rs.rank),
                "--size",
                str(size),
                "--epoch",
                str(number),
                "--dtype",
                self.dtype or "model",
                "--backend",
                backend,
                "--hb-interval",
                str(self.hb_interval),
                "--prefill-chunk",
                str(self.prefill_chunk),
                "--side-host",
                self._host(rs.node_id),
            ]
            if self.model is not None:
                argv += ["--model", str(self.model)]
            if self.layers is not None:
                argv += ["--layers", f"{self.layers[0]}:{self.layers[1]}"]
            launch = asyncio.ensure_future(
                self.launcher.start(rs.node_id, argv, env, directory / f"rank-{rs.rank}.log")
            )
            ep.launching.append((rs, launch))
            rs.handle = await asyncio.shield(launch)  # a cancelled start still records the process to kill
            ep.tasks.append(asyncio.create_task(self._watch_exit(ep, rs)))
        ep.tasks.append(asyncio.create_task(self._monitor(ep)))
        log.info("tensor group epoch %d: %d rank(s) %s over %s", number, size, list(decision.ranks), backend)
        return ep

    def rank_log(self, rank: int) -> str:
        """The current epoch's log of one rank (diagnostics)."""
        ep = self._epoch
        if ep is None:
            return ""
        p = ep.directory / f"rank-{rank}.log"
        return p.read_text(errors="replace") if p.exists() else ""


# ---------------------------------------------------------------------------------------- manual run


def main(argv: list[str] | None = None) -> int:
    """``python -m ringlet.daemon.tensor.group --ranks 3 "Once upon a time"``: a local group on 127.0.0.1."""
    import argparse
    import json

    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    p = argparse.ArgumentParser(description="Run a tensor-parallel group of local ranks (127.0.0.1) once")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or 'model'")
    p.add_argument("--mode", default="tensor", help="tensor (refuse when impossible) or auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    args = p.parse_args(argv)
    dtype = None if args.dtype == "model" else args.dtype
    tok = load_tokenizer(resolve(args.model))
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)

    async def run() -> None:
        group = TPGroup.local(args.model, args.ranks, dtype=dtype, mode=None if args.mode == "auto" else args.mode)
        try:
            await group.start()
            detok = tok.detokenizer
            async for t in group.generate(ids, args.max_tokens, stop_ids=sorted(tok.eos_token_ids)):
                if t not in tok.eos_token_ids:
                    detok.add_token(t)
                    print(detok.last_segment, end="", flush=True)
            detok.finalize()
            print(detok.last_segment)
            info = group.info()
            print(json.dumps({k: info[k] for k in ("mode", "backend", "ranks", "reason")}), file=sys.stderr)
        finally:
            await group.close()

    try:
        asyncio.run(run())
    except (TPRefused, TPGroupError, RingletError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
