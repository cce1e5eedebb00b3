"""Lost layers rebuilt from boundary activations at a commit. A mixin of
:class:`ringlet.daemon.node.Node`, called by :mod:`ringlet.daemon.node.migration`.

When a node dies, its layers ``[a, b)`` go to new holders and its KV is gone. The stage
that sent it hidden states kept them (:mod:`ringlet.daemon.engine.boundary`), so the new
holders rebuild ``[a, b)`` in chain: the holder of ``[a, m)`` pulls the states entering
``a`` from that stage (``FetchBoundary``), runs its layers over them
(:class:`ringlet.daemon.engine.rebuild.Rebuild`) and serves what leaves ``m`` to the holder
of ``[m, b)``, and so on. Each gets pieces of KV that join, as moved ones do, the KV of
its other layers. A request in flight then resumes with one token to prefill, having
cost the cluster ``(b - a) / L`` of a prefill; without the states (evicted, or none kept)
it prefills again from scratch, as counted in ``kv_migration``.

Only what is worth it is rebuilt: the sequences that were in flight, and those that
finished within :data:`RECENT_S` before the re-plan (a request the loss failed was
released just before; an agent's next turn is on its way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import mlx.core as mx

from ringlet.daemon.cluster.kv_sources import boundary_source, rebuilt_spans
from ringlet.daemon.engine.boundary import Boundary, BoundaryError, BoundaryReader, to_chunks
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
#: rebuilding them first: a share of a prefill of every sequence rebuilt).
BOUNDARY_FETCH_TIMEOUT_S = 600.0


class Rebuilding:
    """Boundary rebuilds of :class:`ringlet.daemon.node.Node`."""

    def _init_rebuilding(self) -> None:
        #: the boundaries the old stage held at the last commit: (epoch, boundaries, sequences)
        self._parked_states: tuple[int, list[Boundary], list[Boundary]] = (0, [], [])
        #: layer -> (done, states entering it) that this node rebuilds for the epoch committed
        self._rebuilt: dict[int, tuple[asyncio.Event, list[Boundary]]] = {}
        #: monotonic time of the last rebuilt chunk (requests wait for the rebuild while it progresses)
        self.rebuild_progress_at = 0.0

    def park_states(self, epoch: int, boundaries: list[Boundary], pieces: list[Piece]) -> None:
        """Keep what this node can serve ``FetchBoundary`` calls of ``epoch`` with: the
        states its old stage sent on, and the sequences its pieces hold (the input of
        layer 0: their token ids), those worth rebuilding only."""
        now = time.monotonic()
        worth = [b for b in boundaries if b.inflight or now - b.released_at <= RECENT_S]
        sequences = [Boundary(p.scope, p.tokens, 0, None, True) for p in pieces if p.inflight]
        self._parked_states = (epoch, worth, sequences)
        self._rebuilt = {}

    def rebuild_jobs(self, plan: ServingPlan, gained: list[tuple[int, int]]) -> list[tuple[int, int, object, bool]]:
        """The parts of this node's gained layers that it rebuilds: ``(lo, hi, source,
        from_previous_plan)``, ``source`` the stage that serves the states entering ``lo``
        (``None``: nobody can; those layers' KV is then lost)."""
        jobs = []
        for span in rebuilt_spans(plan.previous, self.plan_num_layers(plan)):
            for a, b in gained:
                lo, hi = max(a, span[0]), min(b, span[1])
                if lo < hi:
                    source, old = boundary_source(lo, span, plan.previous, plan.stages)
                    jobs.append((lo, hi, source, old))
        for _, hi, _, _ in jobs:
            self._rebuilt[hi] = (asyncio.Event(), [])
        return sorted(jobs, key=lambda j: j[0])

    def plan_num_layers(self, plan: ServingPlan) -> int:
        return max((s.end for s in plan.stages), default=0)

    async def rebuild_range(self, plan: ServingPlan, lo: int, hi: int, source, old: bool, report: dict) -> list[Piece]:
        """Rebuild layers ``[lo, hi)`` from the states ``source`` serves; publish the states
        entering ``hi``. Returns the KV pieces (empty when it could not: counted as failed)."""
        name = f"[{lo}, {hi})"
        done, published = self._rebuilt[hi]
        try:
            if source is None:
                raise BoundaryError(f"nobody holds the states entering layer {lo}")
            if source.node_id == self.node_id and old:
                given = self._parked_at(lo)
            else:
                given = await self._fetch_states(plan.epoch, source, lo)
            pieces, outputs = [], []
            t0 = time.perf_counter()
            stage = self.engine.stage
            for g in given:
                job = Rebuild(stage, lo, hi, g, self.config.prefill_chunk)
                if not job.usable:
                    continue
                while not await self.engine.run(job.step):
                    self.rebuild_progress_at = time.monotonic()
                if (made := await self.engine.run(job.result)) is not None:
                    pieces.append(made[0])
                    outputs.append(made[1])
            published.extend(outputs)
            tokens = sum(len(p.tokens) for p in pieces)
            weighted = tokens * (hi - lo) / max(1, self.plan_num_layers(plan))
            for figures in (self.kv_migration, report):
                figures["rebuilt_tokens"] += round(weighted)
            report["rebuilt"][name] = {"sequences": len(pieces), "tokens": tokens,
                                       "seconds": round(time.perf_counter() - t0, 3)}
            if hi == getattr(stage, "end", None):  # a resumed request records on from them
                for b in outputs:
                    kept = Boundary(b.scope, b.tokens, b.layer, b.hidden, released_at=time.monotonic())
                    await self.engine.run(self.engine.boundaries.add, kept)
            log.info("epoch %d: rebuilt layers [%d, %d) of %d sequence(s) (%d tokens) from the states at %d in "
                     "%.2f s", plan.epoch, lo, hi, len(pieces), tokens, lo, time.perf_counter() - t0)
            return pieces
        except Exception as exc:  # noqa: BLE001 - the requests fall back to a full prefill
            report["failed"][f"rebuild [{lo}, {hi})"] = one_line(exc)
            log.warning("epoch %d: cannot rebuild layers [%d, %d): %s", plan.epoch, lo, hi, one_line(exc))
            return []
        finally:
            done.set()

    def _parked_at(self, layer: int) -> list[Boundary]:
        _, boundaries, sequences = self._parked_states
        return sequences if layer == 0 else [b for b in boundaries if b.layer == layer]

    async def _fetch_states(self, epoch: int, source, layer: int) -> list[Boundary]:
        stage = self.engine.stage
        dtype = getattr(mx, self.config.dtype) if self.config.dtype else None
        reader = BoundaryReader(layer, stage.hidden_size, dtype, self.config.transport.max_message_bytes)
        stub = pb_grpc.RingStub(self._channel(source.address))
        call = stub.FetchBoundary(pb.BoundaryRequest(epoch=epoch, layer=layer, node_id=self.node_id),
                                  timeout=BOUNDARY_FETCH_TIMEOUT_S)
        async for chunk in call:
            if chunk.error:
                raise BoundaryError(chunk.error)
            await self.engine.run(reader.add, chunk)
        return await self.engine.run(reader.boundaries)

    async def serve_boundary(self, request: pb.BoundaryRequest) -> AsyncIterator[pb.BoundaryChunk]:
        """``FetchBoundary``: the states entering ``layer`` for the caller's epoch: those
        this node's old stage sent on (or, at layer 0, the sequences it held), or those
        it rebuilds for that epoch (once rebuilt)."""
        if self._committing == request.epoch or any(k[0] == request.epoch for k in self._prepared):
            await self.await_commit(request.epoch)
        epoch, _, _ = self._parked_states
        if epoch != request.epoch:
            yield pb.BoundaryChunk(error=f"{self.node_id[:8]} holds no states for epoch {request.epoch} (it serves "
                                         f"epoch {self.epoch})")
            return
        if request.layer in self._rebuilt:
            done, states = self._rebuilt[request.layer]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=BOUNDARY_FETCH_TIMEOUT_S)
        else:
            states = self._parked_at(request.layer)
        chunks = await self.engine.run(lambda: list(to_chunks(states, self.config.transport.max_message_bytes // 4)))
        for chunk in chunks:
            yield chunk
        log.info("epoch %d: sent the states entering layer %d of %d sequence(s) to %s", request.epoch,
                 request.layer, len(states), request.node_id[:8] or "a peer")
