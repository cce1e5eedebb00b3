"""Rebuilding the KV of layers whose holder was lost, from the boundary activations
entering them (:mod:`ringlet.daemon.engine.boundary`).

Attention is causal and each layer's KV depends only on the hidden states entering it,
so running layers ``[lo, hi)`` over the states that entered ``lo`` gives their KV for
those tokens, and the states entering ``hi`` for the next layers' rebuild. A lost stage
``[a, b)`` therefore costs its new holders ``(b - a) / L`` of a prefill, in chain:
the holder of ``[a, m)`` starts from the states its previous stage kept, the holder of
``[m, b)`` from what the first one computed.

Worker-thread functions (MLX); no I/O.
"""

from __future__ import annotations

import mlx.core as mx

from ringlet.daemon.engine.boundary import Boundary
from ringlet.daemon.engine.kv_pieces import Piece
from ringlet.daemon.engine.prefix_store import snapshot, storable
from ringlet.daemon.engine.stage import Stage


class Rebuild:
    """The rebuild of one sequence's layers ``[lo, hi)``, a chunk of ``chunk`` tokens per
    :meth:`step` (each a call on the worker thread, so that other requests' steps run
    between chunks of a long context).

    Args:
        stage: a stage holding ``[lo, hi)`` (its other layers are not run).
        lo, hi: the layers to rebuild.
        given: the states entering ``lo`` (at layer 0, the token ids).
        chunk: tokens per forward (the prefill chunk: bounds the attention's memory).

    Raises:
        PlanError: ``[lo, hi)`` is not within the stage (at the first :meth:`step`).
    """

    def __init__(self, stage: Stage, lo: int, hi: int, given: Boundary, chunk: int):
        self.stage, self.lo, self.hi, self.given = stage, lo, hi, given
        self.chunk = max(1, chunk)
        self.done_tokens = 0
        self._cache: list | None = None
        self._parts: list[mx.array] = []

    @property
    def usable(self) -> bool:
        """Whether the input can be rebuilt from: some tokens, and at a layer above 0 their
        states, one per token."""
        n = len(self.given.tokens)
        return n > 0 and (self.lo == 0 or (self.given.hidden is not None and self.given.hidden.shape[1] == n))

    def step(self) -> bool:
        """Run the next chunk (worker thread). Returns whether every token is done (also
        when the stage caches anything but plain ``KVCache`` layers: nothing to rebuild)."""
        n = len(self.given.tokens)
        with self.stage.span(self.lo, self.hi):
            if self._cache is None:
                self._cache = self.stage.make_cache()
                if not storable(self._cache):
                    self.done_tokens = n
                    self._cache = []
            if self.done_tokens >= n:
                return True
            t = self.done_tokens
            x = (mx.array([self.given.tokens[t:t + self.chunk]], dtype=mx.int32) if self.lo == 0
                 else self.given.hidden[:, t:t + self.chunk])
            y = self.stage(x, self._cache)
            mx.eval(y, [c.state for c in self._cache])
        self._parts.append(y)
        self.done_tokens = min(n, t + self.chunk)
        return self.done_tokens >= n

    def result(self) -> tuple[Piece, Boundary] | None:
        """Its KV of ``[lo, hi)`` and the states entering ``hi``, once :meth:`step` said
        done (``None`` when nothing could be rebuilt)."""
        n = len(self.given.tokens)
        if not self._cache or not self._parts or self.done_tokens < n:
            return None
        hidden = self._parts[0] if len(self._parts) == 1 else mx.concatenate(self._parts, axis=1)
        b = self.given
        return (Piece(b.scope, list(b.tokens), self.lo, self.hi, snapshot(self._cache, n), b.inflight),
                Boundary(b.scope, list(b.tokens), self.hi, hidden, b.inflight))


def rebuild(stage: Stage, lo: int, hi: int, inputs: list[Boundary], chunk: int) -> tuple[list[Piece], list[Boundary]]:
    """Rebuild ``[lo, hi)`` for every usable input at once (worker thread): the KV pieces
    and the states entering ``hi``, in the inputs' order (see :class:`Rebuild`)."""
    pieces: list[Piece] = []
    outputs: list[Boundary] = []
    for given in inputs:
        job = Rebuild(stage, lo, hi, given, chunk)
        if not job.usable:
            continue
        while not job.step():
            pass
        if (made := job.result()) is not None:
            pieces.append(made[0])
            outputs.append(made[1])
    return pieces, outputs
