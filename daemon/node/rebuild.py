"""Lost layers rebuilt from boundary activations at a commit. A mixin of
:class:`ringlet.daemon.node.Node`, called by :mod:`ringlet.daemon.node.migration`.

When a node dies, its layers ``[a, b)`` go to new holders and its KV is gone. The stage
that sent it hidden states kept them (:mod:`ringlet.daemon.engine.boundary`), so the new
holders rebuild ``[a, b)`` in chain: the holder of ``[a, m)`` pulls the states entering
``a`` from that stage (``FetchBoundary``), runs its layers over them
(:class:`ringlet.daemon.engine.rebuild.Rebuild`) and streams what leaves ``m``, chunk by
chunk as it computes it, to the holder of ``[m, b)``, which works on each chunk as it
comes: the chain runs as a pipeline. Each gets pieces of KV that join, as moved ones
do, the KV of its other layers. A request in flight then resumes with one token to
prefill, having cost the cluster ``(b - a) / L`` of a prefill; without the states
(evicted, or none kept) it prefills again from scratch, as counted in ``kv_migration``.

Only what is worth it is rebuilt: the sequences that were in flight, and those that
finished within :data:`RECENT_S` before the re-plan (a request the loss failed was
released just before; an agent's next turn is on its way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import mlx.core as mx

from ringlet.daemon.cluster.kv_sources import boundary_source, rebuilt_spans
from ringlet.daemon.engine.boundary import Boundary, BoundaryError, BoundaryReader, head_chunk, part_chunks
from ringlet.daemon.engine.kv_pieces import Piece
from ringlet.daemon.engine.rebuild import Rebuild
from ringlet.daemon.errors import one_line
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan

log = logging.getLogger("ringlet.daemon.node")

#: Seconds before a re-plan within which a finished sequence is still rebuilt.
RECENT_S = 60.0
#: Seconds a boundary fetch may take (the holder of the layers before may itself be
#: rebuilding them: a share of a prefill of every sequence rebuilt).
BOUNDARY_FETCH_TIMEOUT_S = 600.0

#: One event of a states stream: (sequence, its scope and ids on its start, token_start, states or None)
Event = tuple[int, Boundary | None, int, mx.array | None]


class StatesLog:
    """The states entering one layer, as a node has or makes them: an append-only list of
    events, closed when complete; readers follow it as it grows."""

    def __init__(self, events: list[Event] | None = None, closed: bool = False):
        self.events: list[Event] = list(events or [])
        self.closed = closed
        self._more = asyncio.Event()

    @classmethod
    def of(cls, boundaries: list[Boundary]) -> StatesLog:
        """A closed log of whole sequences."""
        events: list[Event] = []
        for i, b in enumerate(boundaries):
            events.append((i, Boundary(b.scope, b.tokens, b.layer, None, b.inflight), 0, None))
            if b.hidden is not None:
                events.append((i, None, 0, b.hidden))
        return cls(events, closed=True)

    def append(self, event: Event) -> None:
        self.events.append(event)
        self._more.set()
        self._more = asyncio.Event()

    def close(self) -> None:
        self.closed = True
        self._more.set()

    async def follow(self) -> AsyncIterator[Event]:
        """Every event, the ones to come included, until the log is closed."""
        i = 0
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._more.wait()


def covering(boundaries: list[Boundary]) -> list[Boundary]:
    """The sequences to rebuild so that each of ``boundaries`` is covered once: one whose
    token ids start another's of the same scope and layer is left out (the KV of a prefix
    is the prefix of the KV), and the longer one counts as in flight if either did."""
    kept: list[Boundary] = []
    for b in sorted(boundaries, key=lambda b: -len(b.tokens)):
        longer = next((k for k in kept if (k.scope, k.layer) == (b.scope, b.layer)
                       and k.tokens[:len(b.tokens)] == b.tokens), None)
        if longer is None:
            kept.append(b)
        elif b.inflight and not longer.inflight:
            kept[kept.index(longer)] = Boundary(longer.scope, longer.tokens, longer.layer, longer.hidden, True,
                                                longer.released_at)
    return kept


class Rebuilding:
    """Boundary rebuilds of :class:`ringlet.daemon.node.Node`."""

    def _init_rebuilding(self) -> None:
        #: the epoch committed last, and per layer the states this node serves for it:
        #: those its old stage sent on (closed logs), those its rebuilds make (growing)
        self._states_epoch = 0
        self._states: dict[int, StatesLog] = {}
        #: monotonic time of the last rebuilt chunk (requests wait for the rebuild while it progresses)
        self.rebuild_progress_at = 0.0

    def park_states(self, epoch: int, boundaries: list[Boundary], pieces: list[Piece]) -> None:
        """Keep what this node serves ``FetchBoundary`` calls of ``epoch`` with: the states
        its old stage sent on, and at layer 0 the sequences its pieces held in flight (their
        token ids are that layer's input); only those worth rebuilding."""
        now = time.monotonic()
        worth = covering([b for b in boundaries if b.inflight or now - b.released_at <= RECENT_S])
        self._states_epoch = epoch
        self._states = {layer: StatesLog.of([b for b in worth if b.layer == layer])
                        for layer in {b.layer for b in worth}}
        self._states[0] = StatesLog.of([Boundary(p.scope, p.tokens, 0, None, True) for p in pieces if p.inflight])

    def rebuild_jobs(self, plan: ServingPlan, gained: list[tuple[int, int]]) -> list[tuple[int, int, object, bool]]:
        """The parts of this node's gained layers that it rebuilds: ``(lo, hi, source,
        from_previous_plan)``, ``source`` the stage that serves the states entering ``lo``
        (``None``: nobody can; those layers' KV is then lost)."""
        jobs = []
        for span in rebuilt_spans(plan.previous, max((s.end for s in plan.stages), default=0)):
            for a, b in gained:
                lo, hi = max(a, span[0]), min(b, span[1])
                if lo < hi:
                    source, old = boundary_source(lo, span, plan.previous, plan.stages)
                    jobs.append((lo, hi, source, old))
        for _, hi, _, _ in jobs:
            self._states[hi] = StatesLog()
        return sorted(jobs, key=lambda j: j[0])

    async def rebuild_range(self, plan: ServingPlan, lo: int, hi: int, source, old: bool, report: dict) -> list[Piece]:
        """Rebuild layers ``[lo, hi)`` from the states ``source`` serves, streaming what
        enters ``hi`` as it is made. Returns the KV pieces (none when it could not: counted
        as failed, and those requests prefill again)."""
        out = self._states[hi]
        stage = self.engine.stage
        num_layers = getattr(stage, "num_layers", 0) or 1
        t0 = time.perf_counter()
        pieces: list[Piece] = []
        jobs: dict[int, Rebuild] = {}
        try:
            if source is None:
                raise BoundaryError(f"nobody holds the states entering layer {lo}")
            local = source.node_id == self.node_id and old
            kept = self._states.get(lo) or StatesLog(closed=True)  # none kept here: nothing to rebuild from
            events = kept.follow() if local else self._fetch_states(plan.epoch, source, lo)
            async for index, meta, _, part in events:
                if meta is not None:
                    jobs[index] = Rebuild(stage, lo, hi, meta, self.config.prefill_chunk)
                    out.append((index, Boundary(meta.scope, meta.tokens, hi, None, meta.inflight), 0, None))
                job = jobs[index]
                if part is not None:
                    job.feed(part)
                while job.ready:
                    at = job.done_tokens
                    y = await self.engine.run(job.step)
                    self.rebuild_progress_at = time.monotonic()
                    if y is not None:
                        out.append((index, None, at, y))
                if job.finished and (made := await self.engine.run(job.result)) is not None:
                    pieces.append(made[0])
                    if hi == stage.end:  # a resumed request records on from them
                        kept = Boundary(made[1].scope, made[1].tokens, hi, made[1].hidden, released_at=time.monotonic())
                        await self.engine.run(self.engine.boundaries.add, kept)
                    del jobs[index]
            tokens = sum(len(p.tokens) for p in pieces)
            for figures in (self.kv_migration, report):
                figures["rebuilt_tokens"] += round(tokens * (hi - lo) / num_layers)
            report["rebuilt"][f"[{lo}, {hi})"] = {"sequences": len(pieces), "tokens": tokens,
                                                  "seconds": round(time.perf_counter() - t0, 3)}
            log.info("epoch %d: rebuilt layers [%d, %d) of %d sequence(s) (%d tokens) from the states at %d in "
                     "%.2f s", plan.epoch, lo, hi, len(pieces), tokens, lo, time.perf_counter() - t0)
            return pieces
        except Exception as exc:  # noqa: BLE001 - the requests fall back to a full prefill
            report["failed"][f"rebuild [{lo}, {hi})"] = one_line(exc)
            log.warning("epoch %d: cannot rebuild layers [%d, %d): %s", plan.epoch, lo, hi, one_line(exc))
            return []
        finally:
            out.close()

    async def _fetch_states(self, epoch: int, source, layer: int) -> AsyncIterator:
        stage = self.engine.stage
        dtype = getattr(mx, self.config.dtype) if self.config.dtype else None
        reader = BoundaryReader(layer, stage.hidden_size, dtype, self.config.transport.max_message_bytes)
        stub = pb_grpc.RingStub(self._channel(source.address))
        call = stub.FetchBoundary(pb.BoundaryRequest(epoch=epoch, layer=layer, node_id=self.node_id),
                                  timeout=BOUNDARY_FETCH_TIMEOUT_S)
        async for chunk in call:
            if chunk.error:
                raise BoundaryError(chunk.error)
            yield await self.engine.run(reader.add, chunk)

    async def serve_boundary(self, request: pb.BoundaryRequest) -> AsyncIterator[pb.BoundaryChunk]:
        """``FetchBoundary``: the states entering ``layer`` for the caller's epoch: those
        this node's old stage sent on (at layer 0, the sequences it held), or those it
        rebuilds for that epoch, streamed as they are made."""
        if self._committing == request.epoch or any(k[0] == request.epoch for k in self._prepared):
            await self.await_commit(request.epoch)
        states = self._states.get(request.layer) if self._states_epoch == request.epoch else None
        if states is None:
            yield pb.BoundaryChunk(error=f"{self.node_id[:8]} holds no states entering layer {request.layer} for "
                                         f"epoch {request.epoch} (it serves epoch {self.epoch})")
            return
        limit = self.config.transport.max_message_bytes // 4
        sequences = 0
        async for index, meta, at, part in states.follow():
            if meta is not None:
                sequences += 1
                yield head_chunk(index, meta)
            if part is not None:
                for chunk in await self.engine.run(lambda p=part, t=at, i=index: list(
                        part_chunks(i, request.layer, t, p, limit))):
                    yield chunk
        log.info("epoch %d: sent the states entering layer %d of %d sequence(s) to %s", request.epoch,
                 request.layer, sequences, request.node_id[:8] or "a peer")
