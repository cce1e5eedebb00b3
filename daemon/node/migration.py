"""KV caches move with their layers on a re-plan. A mixin of :class:`ringlet.daemon.node.Node`.

Without this, a re-plan drops every KV cache and each request in flight resumes by
prefilling its prompt and tokens so far again: minutes for a 100k-token agent context.
With it, at each commit of a pipeline plan:

0. while it prepares the new plan (the old one serving on), a node that gains layers pulls
   a snapshot of their KV from their holders (:meth:`Migration.precopy`), so that at the
   commit only what changed since (the tokens decoded meanwhile) is left to move;
1. the node parks the KV it holds (requests in flight, prefix-cache entries) as pieces of
   its old layer range (:func:`ringlet.daemon.engine.kv_handoff.park`);
2. it keeps the layers it still holds, and keeps the others for their new holders, who
   pull them with ``FetchKV`` (:meth:`Migration.serve_kv`);
3. it pulls the layers it gained from their old holders (the plan's ``previous``
   stages), naming the snapshot it holds so that only the rest comes, joins everything
   into sequences over its new range and puts them in its prefix store (requests in
   flight pinned); a range whose holder is lost is rebuilt instead
   (:mod:`ringlet.daemon.node.rebuild`);
4. the API node resumes each request as before; every stage now finds its tokens in
   its prefix store, so the request prefills one token: the one its next decode step
   would have computed anyway.

A holder that is gone (killed) or parked nothing leaves those sequences uncovered; their
requests then prefill from scratch (counted in ``kv_migration.full_reprefills``). A
leaving node (``SIGTERM``, not in the new plan) serves a snapshot of what it holds when
asked, and waits (up to :data:`HANDOFF_WAIT_S`) until its layers have been fetched
before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import mlx.core as mx

from ringlet.daemon.cluster import features
from ringlet.daemon.engine import kv_handoff
from ringlet.daemon.engine.kv_pieces import (
    KVPieceError,
    Piece,
    PieceReader,
    held_prefix,
    range_minus,
    to_chunks,
    token_digest,
)
from ringlet.daemon.engine.stage import Stage
from ringlet.daemon.errors import one_line
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan

log = logging.getLogger("ringlet.daemon.node")

#: Seconds a stage holds the first prefill chunk of a request while it still joins the
#: KV it fetched on a re-plan (a fetch moves KV bytes at link speed; this bounds a stall).
INSTALL_WAIT_S = 30.0
#: Seconds a leaving node waits for its layers' new holders to fetch their KV.
HANDOFF_WAIT_S = 10.0
#: Seconds one KV fetch from one old holder may take (a holder that cannot be reached
#: fails at once; this bounds one that stops answering mid-stream).
FETCH_TIMEOUT_S = 30.0
#: Seconds the snapshot pulled while preparing may take in all (what is not pulled by then
#: moves at the commit).
PRECOPY_TIMEOUT_S = 120.0
#: The counters of ``kv_migration`` (totals) and of each re-plan's figures.
#: ``rebuilt_tokens``: tokens of KV rebuilt from boundary activations, weighted by the share
#: of the model's layers rebuilt (a sequence of n tokens whose lost 10 of 30 layers were
#: rebuilt counts n / 3: the prefill it cost). ``states_not_sent``: sequences whose layers
#: another node fetched but that hold whole states (windows, recurrent states: no wire
#: form, :mod:`ringlet.daemon.engine.cache_kinds`): the request needing them prefills again.
COUNTERS = ("kv_bytes_received", "kv_bytes_sent", "resumed", "reprefilled_tokens", "full_reprefills",
            "rebuilt_tokens", "precopied_bytes", "states_not_sent")


class Migration:
    """KV migration of :class:`ringlet.daemon.node.Node`."""

    def _init_migration(self) -> None:
        self._handoff: tuple[int, list[Piece]] = (0, [])  # (epoch committed, pieces given away)
        self._committing = 0  # the epoch a commit is switching to now (0: none)
        self._installed = asyncio.Event()
        self._installed.set()
        self._served: list[tuple[int, int]] = []  # layer ranges fetched from this node
        #: the snapshot pulled while preparing: (epoch, (holder id, start, end) -> pieces)
        self._precopied: tuple[int, dict[tuple[str, int, int], list[Piece]]] = (0, {})
        #: figures for /v1/cluster: the last re-plan's, and totals since start
        self.kv_migration: dict = {"last": None, **dict.fromkeys(COUNTERS, 0)}

    def replan_figures(self, epoch: int) -> dict:
        """``kv_migration["last"]``: the figures of the re-plan to ``epoch`` (made afresh
        when the last ones are of another epoch)."""
        last = self.kv_migration["last"]
        if last is None or last.get("epoch") != epoch:
            last = {"epoch": epoch, **dict.fromkeys(COUNTERS, 0), "from": {}, "precopied": {}, "rebuilt": {},
                    "failed": {}}
            self.kv_migration["last"] = last
        return last

    def count_resume(self, tokens: int, cached: int) -> None:
        """A request resumed on a new plan with ``tokens`` of context, ``cached`` of them
        from the stages' prefix stores: what it prefilled beyond the one token its next
        step computes anyway is counted (all of it, when nothing was cached, as a full
        re-prefill), in the totals and in the current epoch's figures."""
        for figures in (self.kv_migration, self.replan_figures(self.epoch)):
            figures["resumed"] += 1
            figures["reprefilled_tokens"] += max(0, tokens - 1 - cached)
            figures["full_reprefills"] += int(cached == 0 and tokens > 1)

    def _moves_kv(self, plan: ServingPlan) -> bool:
        """Whether KV moves with its layers into ``plan``: a pipeline plan, with ``--kv-migration on``."""
        return self.config.kv_migration and not plan.infeasible and not plan.is_tensor and not plan.is_hybrid

    # --- while preparing -------------------------------------------------------------------

    def _kv_sources(self, plan: ServingPlan, gained: list[tuple[int, int]]) -> tuple[list, list, dict[str, str]]:
        """Where the gained layers' KV comes from: holders to pull it from ``[(stage, start,
        end)]``; holders still here whose range the proposer chose to recompute (the
        rebuild comes first, then what it did not cover, if anything, is pulled from them:
        the states it starts from may not all be kept); and the holders that are gone
        (``name -> why``): their KV went with them. A lost range is one of the rebuilds."""
        sources, after, lost = [], [], {}
        departed = self.cluster.membership.departed if self.cluster is not None else {}
        members = self.cluster.membership.members if self.cluster is not None else {}
        for a, b in gained:
            for s in plan.previous:
                lo, hi = max(a, s.start), min(b, s.end)
                if lo >= hi or s.node_id == self.node_id:
                    continue
                gone = s.lost or departed.get(s.node_id, "stopped") != "stopped" and s.node_id not in members
                if gone and not s.rebuild:
                    lost[f"{s.node_id[:8]} [{lo}, {hi})"] = f"lost ({departed[s.node_id]})"  # its KV went with it
                elif not gone:
                    (after if s.rebuild else sources).append((s, lo, hi))
        return sources, after, lost

    async def precopy(self, plan: ServingPlan, start: int, end: int) -> None:
        """Pull, while the old plan serves, a snapshot of the KV of the layers this node
        gains in ``plan`` (its new stage is ``[start, end)``) from their holders; at the
        commit they send only what changed since. Never raises: whatever is not pulled
        moves at the commit."""
        if not self._moves_kv(plan):
            return
        old = self.engine.stage
        old_range = (old.start, old.end) if isinstance(old, Stage) else None
        sources, _, _ = self._kv_sources(plan, range_minus((start, end), old_range))
        if not sources:
            return
        t0 = time.perf_counter()
        got: dict[tuple[str, int, int], list[Piece]] = {}

        async def pull(spec, a: int, b: int) -> None:
            with contextlib.suppress(Exception):  # moves at the commit instead
                got[(spec.node_id, a, b)], _ = await self._fetch_kv(plan.epoch, spec, a, b, snapshot=True)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(pull(*s) for s in sources)), timeout=PRECOPY_TIMEOUT_S)
        self._precopied = (plan.epoch, got)
        nbytes = sum(p.nbytes for pieces in got.values() for p in pieces)
        report = self.replan_figures(plan.epoch)
        report["precopied_bytes"] += nbytes
        for (node_id, a, b), pieces in got.items():
            report["precopied"][f"{node_id[:8]} [{a}, {b})"] = sum(p.nbytes for p in pieces)
        self.kv_migration["precopied_bytes"] += nbytes
        report["precopy_seconds"] = round(time.perf_counter() - t0, 3)
        log.info("epoch %d: pulled a snapshot of %.1f MB of KV from %d holder(s) while preparing, in %.2f s",
                 plan.epoch, nbytes / 1e6, len(got), time.perf_counter() - t0)

    # --- at commit -----------------------------------------------------------------------

    async def _swap_moving_kv(self, plan: ServingPlan, stage) -> None:
        """Switch the engine to ``stage`` of ``plan``, keeping the KV this node still holds
        and fetching the layers it gained (see the module docstring)."""
        old = self.engine.stage
        old_range = (old.start, old.end) if isinstance(old, Stage) else None
        new_range = (stage.start, stage.end) if isinstance(stage, Stage) else None
        pipeline = self._moves_kv(plan)
        keep = pipeline and old_range is not None
        pieces, boundaries = await self.engine.swap_stage(stage, keep=keep)
        own = [q for p in pieces if new_range and (q := p.within(*new_range)) is not None]
        given = [q for p in pieces for q in (p.outside(*new_range) if new_range else [p])]
        self._handoff = (plan.epoch, given)
        self.park_states(plan.epoch, boundaries, pieces)
        self._served = []
        if not pipeline or new_range is None:
            return
        gained = range_minus(new_range, old_range)
        jobs = self.rebuild_jobs(plan, gained)
        sources, after, lost = self._kv_sources(plan, gained)
        if lost:
            self.replan_figures(plan.epoch)["failed"].update(lost)
        if not own and not sources and not jobs and not after:
            return
        if lost:
            log.info("epoch %d: no KV to fetch from %s: requests that needed it prefill again", plan.epoch,
                     ", ".join(lost))
        self._installed = asyncio.Event()
        self._spawn(self._gather_kv(plan, own, sources, jobs, after, new_range, self._installed))

    async def _gather_kv(self, plan: ServingPlan, own: list[Piece], sources: list, jobs: list, after: list,
                         new_range: tuple[int, int], done: asyncio.Event) -> None:
        t0 = time.perf_counter()
        report = self.replan_figures(plan.epoch)
        try:
            rebuilding = asyncio.gather(*(self.rebuild_range(plan, *job, report) for job in jobs))
            fetched = await asyncio.gather(*(self._fetch_kv(plan.epoch, s, a, b) for s, a, b in sources),
                                           return_exceptions=True)
            rebuilt = [p for made in await rebuilding for p in made]
            pieces = list(own) + rebuilt
            if after:  # the rest of what was recomputed by choice, from holders still here
                fetched += await asyncio.gather(*(self._fetch_kv(plan.epoch, s, a, b, held=[
                    q for p in rebuilt if not p.exact and p.start <= a and p.end >= b
                    and (q := p.within(a, b)) is not None])
                    for s, a, b in after), return_exceptions=True)
                sources = sources + after
            for (spec, a, b), result in zip(sources, fetched, strict=True):
                name = f"{spec.node_id[:8]} [{a}, {b})"
                if isinstance(result, BaseException):
                    report["failed"][name] = one_line(result)
                    continue
                got, nbytes = result
                pieces.extend(got)
                report["from"][name] = nbytes
                report["kv_bytes_received"] += nbytes
            installed = await self.engine.run(kv_handoff.install, self.engine.prefix, pieces, *new_range)
            report.update(sequences=installed.sequences, inflight=installed.inflight, tokens=installed.tokens,
                          inflight_tokens=installed.inflight_tokens, bytes=installed.nbytes,
                          left_out=installed.left_out, seconds=round(time.perf_counter() - t0, 3))
            self.kv_migration["kv_bytes_received"] += report["kv_bytes_received"]
            log.info("epoch %d: KV kept for %d sequence(s) (%d in flight, %d tokens) over layers [%d, %d); "
                     "received %.1f MB from %d holder(s)%s in %.2f s", plan.epoch, installed.sequences,
                     installed.inflight, installed.tokens, *new_range, report["kv_bytes_received"] / 1e6,
                     len(report["from"]), "; failed: " + "; ".join(f"{k}: {v}" for k, v in report["failed"].items())
                     if report["failed"] else "", report["seconds"])
            rebuilt = "".join(f"; rebuilt layers {k} of {v['sequences']} sequence(s) ({v['tokens']} tokens)"
                              for k, v in report["rebuilt"].items())
            self.event("kv", f"epoch {plan.epoch}: KV of {installed.inflight} request(s) in flight and "
                             f"{installed.sequences - installed.inflight} cached prefix(es) kept; received "
                             f"{report['kv_bytes_received'] / 1e6:.1f} MB{rebuilt}")
        except Exception:  # the requests fall back to a full prefill; the node keeps serving
            log.exception("epoch %d: KV migration failed", plan.epoch)
        finally:
            done.set()

    async def _fetch_kv(self, epoch: int, spec, start: int, end: int, snapshot: bool = False,
                        held: list[Piece] | None = None) -> tuple[list[Piece], int]:
        """Pull layers ``[start, end)`` from ``spec``'s node: its snapshot now (``snapshot``,
        while preparing), else what it parked at the commit, less what this node holds of
        it already (``held``, by default the snapshot pulled from it). Returns pieces and
        the bytes that came."""
        dtype = getattr(mx, self.config.dtype) if self.config.dtype else None
        max_bytes = self.config.transport.max_message_bytes
        epoch_held, precopied = self._precopied
        if held is None:
            held = [] if snapshot or epoch_held != epoch else precopied.get((spec.node_id, start, end), [])
        reader = PieceReader(start, end, dtype, max_bytes, held=held)
        stub = pb_grpc.RingStub(self._channel(spec.address))
        have = [pb.KVHave(scope=p.scope, tokens=len(p.tokens), digest=token_digest(p.tokens)) for p in held]
        call = stub.FetchKV(pb.KVRequest(epoch=epoch, start=start, end=end, node_id=self.node_id, snapshot=snapshot,
                                         have=have), timeout=FETCH_TIMEOUT_S)
        async for chunk in call:
            if chunk.error:
                raise KVPieceError(chunk.error)
            await self.engine.run(reader.add, chunk)
        return await self.engine.run(reader.pieces), reader.nbytes

    async def await_installed(self) -> None:
        """Wait until the KV fetched or rebuilt on the last re-plan is in this node's prefix
        store: up to :data:`INSTALL_WAIT_S`, or as long as a rebuild makes progress."""
        deadline = time.monotonic() + INSTALL_WAIT_S
        while not self._installed.is_set():
            left = max(deadline, self.rebuild_progress_at + INSTALL_WAIT_S) - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._installed.wait()), timeout=min(left, 1.0))

    # --- the old holder's side -------------------------------------------------------------

    async def _held_within(self, start: int, end: int) -> list[Piece]:
        """The KV this node holds now (nothing dropped), within layers ``[start, end)``."""
        if not isinstance(self.engine.stage, Stage):
            return []
        held = await self.engine.run(self.engine.kv_pieces)
        return [q for p in held if (q := p.within(start, end)) is not None]

    async def serve_kv(self, request: pb.KVRequest) -> AsyncIterator[pb.KVChunk]:
        """``FetchKV``: the KV of layers ``[start, end)`` this node held before the caller's
        epoch. A member of that epoch answers once it has committed it (with what it
        parked then); a node outside it (leaving) answers with what it holds now; a
        snapshot is what it holds now, the old plan serving on. Of a sequence the caller
        says it holds (``have``), only the tokens it lacks are sent. Whole states never go
        (:func:`~ringlet.daemon.engine.kv_handoff.declined`), nor, to a caller without
        :data:`~ringlet.daemon.wire.versions.KV_KINDS` (release 0.1.0, which refuses a
        cacheless layer's 0-wide keys), sequences of other kinds than plain KV: the
        request needing them prefills again there, counted as ``states_not_sent``."""
        if request.snapshot:  # the caller prepares request.epoch; this node serves the old plan on
            pieces = await self._held_within(request.start, request.end)
        else:
            joining = self._committing == request.epoch or any(k[0] == request.epoch for k in self._prepared)
            if joining:
                await self.await_commit(request.epoch)
            epoch, given = self._handoff
            if epoch == request.epoch:
                pieces = [q for p in given if (q := p.within(request.start, request.end)) is not None]
            elif self.epoch < request.epoch and not joining and isinstance(self.engine.stage, Stage):
                pieces = await self._held_within(request.start, request.end)
            else:
                yield pb.KVChunk(error=f"{self.node_id[:8]} holds no KV for epoch {request.epoch} (it serves epoch "
                                       f"{self.epoch})")
                return
        pieces = [p for p in pieces if (p.start, p.end) == (request.start, request.end)]
        asked = len(pieces)
        pieces = kv_handoff.declined(pieces, request.start, request.end)  # whole states stay here
        cluster = getattr(self, "cluster", None)
        if not features.members_speak(cluster, versions.KV_KINDS, [request.node_id]):  # an older release: plain KV only
            pieces = [p for p in pieces if all(k.size for k, _ in p.layers)]  # (not a cacheless layer's 0-wide keys)
        if not request.snapshot and asked > len(pieces):  # counted once, at the commit's fetch
            self.kv_migration["states_not_sent"] += asked - len(pieces)
            self.replan_figures(request.epoch)["states_not_sent"] += asked - len(pieces)
        held = [held_prefix(p, list(request.have)) for p in pieces] if request.have else None
        chunks = await self.engine.run(lambda: list(to_chunks(pieces, self.config.transport.max_message_bytes // 4,
                                                              held)))
        sent = sum(len(c.keys.data) + len(c.values.data) for c in chunks)
        for chunk in chunks:
            yield chunk
        if request.snapshot:
            log.info("epoch %d: sent a snapshot of the KV of layers [%d, %d) to %s: %d sequence(s), %.1f MB",
                     request.epoch, request.start, request.end, request.node_id[:8] or "a peer", len(pieces),
                     sent / 1e6)
            return
        self._served.append((request.start, request.end))
        self.kv_migration["kv_bytes_sent"] += sent
        self.replan_figures(request.epoch)["kv_bytes_sent"] += sent
        log.info("epoch %d: sent the KV of layers [%d, %d) to %s: %d sequence(s), %.1f MB", request.epoch,
                 request.start, request.end, request.node_id[:8] or "a peer", len(pieces), sent / 1e6)

    async def await_handoff(self, deadline: float) -> None:
        """Before a leaving node exits: wait until its layers have been fetched (or the
        deadline, ``time.monotonic()``, or :data:`HANDOFF_WAIT_S`)."""
        stage = self.engine.stage if self.engine is not None else None
        if not isinstance(stage, Stage) or not self.engine.active_requests and not len(self.engine.prefix):
            return
        until = min(deadline, time.monotonic() + HANDOFF_WAIT_S)
        while time.monotonic() < until:
            covered = sorted(self._served)
            at = stage.start
            for a, b in covered:
                if a <= at:
                    at = max(at, b)
            if at >= stage.end:
                return
            await asyncio.sleep(0.05)
