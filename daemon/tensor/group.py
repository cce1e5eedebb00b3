"""Supervisor of a tensor-parallel group: start the ranks, watch them, recover, serve.

:class:`TPGroup` owns one tensor group (``mode == "tensor"``, every member holds
every layer split by ``model.shard``). It

* plans with :func:`ringlet.daemon.tensor.planning.decide` (``--mode`` override kept),
* runs the group in epochs (:mod:`ringlet.daemon.tensor.group_epochs`): writes MLX's
  host configuration into an epoch directory, starts one
  :mod:`ringlet.daemon.tensor.worker` process per rank (through a
  :class:`~ringlet.daemon.tensor.launch.RankLauncher`;
  :class:`~ringlet.daemon.tensor.launch.LocalLauncher` starts them on this machine, each
  in its own process group), releases the MLX group only once every rank has loaded
  the model, watches it (rank exits, closed control connections, heartbeats, stuck
  steps) and on failure kills every rank, drops the lost members, re-plans tensor mode
  on the survivors -- or falls back to one process on the leader when the heads do not
  divide (``fallback="single"``) -- and starts a new epoch,
* serves requests (:mod:`ringlet.daemon.tensor.group_requests`) and resumes each
  in-flight one after a restart by re-prefilling prompt + tokens so far (same seed,
  random key advanced past the tokens already drawn), so the caller's stream continues
  where it was; greedy output equals an undisturbed run.

The leader (rank 0's member) is this node: losing its rank process restarts the
group on the same members (up to ``max_restarts`` times in a row, then one
process).

Stage mode (``layers=(start, end)``, a hybrid plan's group): the ranks hold only that
layer range and :meth:`TPGroup.stage_forward` runs one forward of it -- token ids or
hidden states in, hidden states or the last position's logits out -- for a KV-cache
slot the caller names (or one batched decode step of several slots). The caller
(:mod:`ringlet.daemon.tensor.group_stage`) keeps sampling and the ring; a restart loses the
slots' caches, which :class:`~ringlet.daemon.tensor.group_errors.TPStageLost` reports.

Public API (asyncio)::

    group = TPGroup.local(model, ranks=3, dtype="float32")   # or TPGroup(model, members, links, ...)
    decision = await group.start()
    async for token_id in group.generate(prompt_ids, max_tokens, sampling, stop_ids): ...
    group.info()     # {"mode", "backend", "ranks", "size", "epoch", "state", "reason", ...}
    await group.close()

A manual run: ``python -m ringlet.daemon.tensor.group_cli`` (:mod:`ringlet.daemon.tensor.group_cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ringlet.daemon.tensor.group_epochs import GroupEpochs
from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.tensor.group_requests import GroupRequests, Req
from ringlet.daemon.tensor.group_state import Epoch
from ringlet.daemon.tensor.launch import LocalLauncher, RankLauncher
from ringlet.daemon.tensor.planning.decision import TPDecision, decide
from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember, TPModelSpec, tp_spec_from_config
from ringlet.daemon.tensor.planning.links import loopback_links

# ---------------------------------------------------------------------------------------- model spec


def model_tp_spec(location, dtype: str | None = "float32") -> TPModelSpec:
    """Head counts and bytes of a model for :func:`~ringlet.daemon.tensor.planning.decision.decide`,
    without reading weights."""
    from ringlet.daemon.engine.modelspec import model_spec_from_model
    from ringlet.daemon.engine.stage import build_lazy_model

    model, config = build_lazy_model(location, dtype)
    ms = model_spec_from_model(model, context_tokens=1, name=location.name, config=config)
    total = sum(ms.layer_bytes) + ms.embedding_bytes + ms.head_bytes
    quant = config.get("quantization")
    spec = tp_spec_from_config(
        config,
        total,
        ms.embedding_bytes + ms.head_bytes,
        shardable=callable(getattr(model, "shard", None)),
        activation_itemsize=4 if dtype in (None, "float32") else 2,
        name=location.name,
        num_layers=len(ms.layer_bytes),
    )
    if quant is None and location.kind == "gguf" and dtype is None:
        from ringlet.daemon.engine import gguf as gguf_source

        spec = TPModelSpec(**{**spec.__dict__, "quant_group_size": gguf_source.GROUP})
    return spec



class TPGroup(GroupRequests, GroupEpochs):
    """A supervised tensor-parallel group serving generation requests.

    Args:
        model: ``--model`` (path or short name; ``None`` = the default model).
        members: candidate members; ``leader`` (default: the first) is this node.
        links: links between members (:mod:`ringlet.daemon.tensor.planning.links` helpers).
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
        self._epoch: Epoch | None = None
        self._epochs = itertools.count(1)
        self._reqs: dict[str, Req] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._port = 0
        self._manager: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._closing = False
        self._fatal: BaseException | None = None
        self._last_why = ""
        #: rank 0's prefix cache figures after the last request (``None`` before one)
        self.prefix_info: dict | None = None

    @classmethod
    def local(cls, model: str | None, ranks: int, *, memory: int = 64 << 30, **kw: Any) -> TPGroup:
        """``ranks`` simulated members on 127.0.0.1 (``rank0``..), loopback links, this machine."""
        members = [TPMember(f"rank{i}", "127.0.0.1", memory) for i in range(ranks)]
        return cls(model, members, loopback_links([m.node_id for m in members]), **kw)

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
        decision = self._initial or decide(self.alive, self.links, self.spec, self.mode, leader=self.leader)
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

    # ------------------------------------------------------------------------------------ diagnostics

    def info(self) -> dict[str, Any]:
        """Mode, backend, ranks (node ids in rank order), size, epoch, state, reason, pids, restarts,
        and ``trims``: every rank's KV caches drop drafted positions exactly (speculative decoding)."""
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
            "trims": self.trims,
        }

    @property
    def trims(self) -> bool:
        """Whether every rank of the current epoch reported KV caches that drop drafted
        positions exactly (speculative decoding runs on the group only then)."""
        ep = self._epoch
        return bool(ep and ep.ranks and all(r.trims for r in ep.ranks))

    def rank_pids(self) -> dict[int, int]:
        ep = self._epoch
        return {r.rank: r.handle.pid for r in ep.ranks if r.handle} if ep else {}
