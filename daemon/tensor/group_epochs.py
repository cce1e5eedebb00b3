"""The epoch/restart state machine of a tensor group: start the ranks, watch them, recover.

One *epoch* is one start of the group's rank processes. :class:`GroupEpochs` (a part of
:class:`ringlet.daemon.tensor.group.TPGroup`)

* writes MLX's host configuration (:func:`~ringlet.daemon.tensor.planning.mlx_hosts.host_config`) into an epoch
  directory and starts one :mod:`ringlet.daemon.tensor.worker` process per rank
  (through a :class:`~ringlet.daemon.tensor.launch.RankLauncher`),
* takes every rank's control connection on a loopback TCP server, releases the
  MLX group only once every rank has loaded the model (``init``), and watches
  it: a rank process that exits, a closed control connection, a heartbeat that
  stops for ``hb_timeout`` or a step that runs longer than ``step_timeout`` (a
  ring collective whose peer died never returns -- mlx issue #3862) all fail the
  group,
* on failure kills every rank (SIGKILL to each process group), drops the lost
  members, re-plans tensor mode on the survivors -- or falls back to one process
  on the leader when the heads do not divide (``fallback="single"``) -- and starts a
  new epoch, whose requests in flight the request plumbing then resumes
  (:mod:`ringlet.daemon.tensor.group_requests`).

The leader (rank 0's member) is this node: losing its rank process restarts the
group on the same members (up to ``max_restarts`` times in a row, then one
process).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import time

from ringlet.daemon.tensor.control import TOKEN_ENV, encode_message, read_frame
from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.tensor.group_state import Epoch, RankState
from ringlet.daemon.tensor.launch import free_port_block
from ringlet.daemon.tensor.planning.decision import TPDecision, TPRefused, decide
from ringlet.daemon.tensor.planning.mlx_hosts import host_config

log = logging.getLogger("ringlet.daemon.tensor.group")


#: Seconds between the first failure signal and the teardown, to learn which member was lost.
FAILURE_GRACE = 0.3
#: An epoch that served this many seconds before failing resets the restart count.
STABLE_AFTER = 60.0


class GroupEpochs:
    """The epochs of a :class:`~ringlet.daemon.tensor.group.TPGroup`: its rank processes, their
    control connections, failure detection, teardown, re-planning and restarts (the
    group's configuration and state attributes are set by ``TPGroup.__init__``)."""

    # ------------------------------------------------------------------------------------ request hooks
    # (the request plumbing, :class:`~ringlet.daemon.tensor.group_requests.GroupRequests`, provides them)

    def _resume_requests(self, ep: Epoch) -> None:
        """``ep`` serves: send it the requests in flight (those of a failed epoch resume)."""
        raise NotImplementedError

    def _fail_requests(self, why: str) -> None:
        """The group failed for good: end every request in flight with ``why``."""
        raise NotImplementedError

    def _on_answer(self, t: str, msg: dict) -> None:
        """Rank 0 answered a request (``tok``, ``done``, ``logits``, ``bench``, ``error``, ``out``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------ control server

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rs: RankState | None = None
        ep: Epoch | None = None
        try:
            hello = await asyncio.wait_for(read_frame(reader), 30)
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
                msg = await read_frame(reader)
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

    def _on_message(self, ep: Epoch, rs: RankState, msg: dict) -> None:
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
            rs.ready, rs.trims = True, bool(msg.get("trims"))
            if all(r.ready for r in ep.ranks):
                ep.all_ready.set()
        elif t == "fatal":  # it leaves by itself: not a lost member (often it saw a peer vanish)
            self._fail(ep, set(), f"rank {rs.rank} ({rs.node_id}) failed: {msg.get('msg')}")
        elif t in ("tok", "done", "logits", "bench", "error", "out"):
            self._on_answer(t, msg)

    def _write(self, r: RankState, msg: dict, data: bytes | None = None) -> None:
        if r.writer is not None and not r.writer.is_closing():
            r.writer.write(encode_message(msg, data))

    # ------------------------------------------------------------------------------------ failure

    def _fail(self, ep: Epoch, lost: set[str], why: str) -> None:
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

    async def _watch_exit(self, ep: Epoch, rs: RankState) -> None:
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
    def _log_tail(ep: Epoch, rank: int) -> str:
        p = ep.directory / f"rank-{rank}.log"
        try:
            lines = [x for x in p.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    async def _monitor(self, ep: Epoch) -> None:
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

    async def _teardown(self, ep: Epoch, graceful: bool = False) -> None:
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
            return decide(self.alive, self.links, self.spec, "tensor", leader=self.leader)
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
                    self._resume_requests(ep)
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
            self._fail_requests(f"tensor group failed: {exc}")
            log.error("tensor group failed: %s", exc)
            ep = self._epoch
            if ep is not None and not ep.torn:  # e.g. a rank of a new epoch could not start: stop the others
                with contextlib.suppress(Exception):
                    await self._teardown(ep)

    async def _wait_ready(self, ep: Epoch) -> bool:
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

    def _side_address(self, ep: Epoch) -> str | None:
        port = ep.ranks[0].side_port
        return f"{self._host(ep.ranks[0].node_id)}:{port}" if port else None

    async def _start_epoch(self, decision: TPDecision) -> Epoch:
        self.decision = decision
        number = next(self._epochs)
        size = len(decision.ranks)
        backend = decision.backend if size > 1 else "none"
        directory = self.workdir / f"epoch-{number}"
        directory.mkdir(parents=True, exist_ok=True)
        ep = Epoch(
            number=number,
            decision=decision,
            size=size,
            backend=backend,
            token=secrets.token_hex(16),
            directory=directory,
            ranks=[RankState(i, n) for i, n in enumerate(decision.ranks)],
        )
        self._epoch = ep
        self.state = "starting"
        self._ready.clear()
        if size > 1:
            by_id = {m.node_id: m for m in self.alive}
            hosts = {by_id[n].host for n in decision.ranks}
            base = free_port_block(size + 1, next(iter(hosts)) if len(hosts) == 1 else "127.0.0.1")
            ep.host_config = host_config(decision.ranks, backend, self.alive, self.links, base_port=base)
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
