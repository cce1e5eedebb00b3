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

from ringlet.daemon.engine import cache_kinds
from ringlet.daemon.engine.boundary import Boundary
from ringlet.daemon.engine.kv_pieces import Piece
from ringlet.daemon.engine.prefix_store import snapshot, storable
from ringlet.daemon.engine.stage import Stage


class Rebuild:
    """The rebuild of one sequence's layers ``[lo, hi)``, a chunk of at most ``chunk``
    tokens per :meth:`step` (each a call on the worker thread, so that other requests'
    steps run between chunks of a long context). The states entering ``lo`` may come in
    parts (:meth:`feed`), as the holder of the layers before rebuilds them: a chain of
    holders then works as a pipeline, each on the chunk after its predecessor's.

    Args:
        stage: a stage holding ``[lo, hi)`` (its other layers are not run).
        lo, hi: the layers to rebuild.
        given: the sequence (scope, token ids, in flight or not) and the states entering
            ``lo`` received so far (``None``: none yet; at layer 0 the token ids are the input).
        chunk: tokens per forward (the prefill chunk: bounds the attention's memory).

    Raises:
        PlanError: ``[lo, hi)`` is not within the stage (at the first :meth:`step`).
    """

    def __init__(self, stage: Stage, lo: int, hi: int, given: Boundary, chunk: int):
        self.stage, self.lo, self.hi, self.given = stage, lo, hi, given
        self.chunk = max(1, chunk)
        self.done_tokens = 0
        self._cache: list | None = None
        self._inputs: list[mx.array] = [given.hidden] if given.hidden is not None else []
        self._parts: list[mx.array] = []

    @property
    def total(self) -> int:
        """Tokens of the sequence."""
        return len(self.given.tokens)

    @property
    def fed(self) -> int:
        """Tokens whose input is here (all of them at layer 0)."""
        return self.total if self.lo == 0 else sum(x.shape[1] for x in self._inputs)

    def feed(self, part: mx.array) -> None:
        """More states entering ``lo``: ``(1, t, hidden_size)``, the next ``t`` tokens."""
        self._inputs.append(part)

    @property
    def ready(self) -> bool:
        """Whether :meth:`step` has a chunk to run: a whole one, or the rest of the sequence."""
        left = self.total - self.done_tokens
        return left > 0 and self.fed - self.done_tokens >= min(self.chunk, left)

    @property
    def finished(self) -> bool:
        return self.done_tokens >= self.total

    def step(self) -> mx.array | None:
        """Run the next chunk of what was fed (worker thread). Returns the states it sends
        on to ``hi``, ``(1, t, hidden_size)`` (``None``: nothing to run). Any cache kind
        rebuilds exactly, from the first token on (a window's or a recurrent state then
        comes whole, at exactly the sequence's length)."""
        with self.stage.span(self.lo, self.hi):
            if self._cache is None:
                self._cache = self.stage.make_cache()
            t = self.done_tokens
            n = min(self.chunk, self.fed - t)
            if self.finished or n <= 0:
                return None
            if self.lo == 0:
                x = mx.array([self.given.tokens[t:t + n]], dtype=mx.int32)
            else:
                if len(self._inputs) > 1:
                    self._inputs = [mx.concatenate(self._inputs, axis=1)]
                x = self._inputs[0][:, t:t + n]
            y = self.stage(x, self._cache)
            mx.eval(y, [c.state for c in self._cache])
        self._parts.append(y)
        self.done_tokens = t + n
        return y

    def result(self) -> tuple[Piece, Boundary] | None:
        """Its KV of ``[lo, hi)`` and the states entering ``hi``, once :attr:`finished`
        (``None`` when nothing could be rebuilt)."""
        n = self.total
        if not self._cache or not self._parts or self.done_tokens < n:
            return None
        hidden = self._parts[0] if len(self._parts) == 1 else mx.concatenate(self._parts, axis=1)
        b = self.given
        layers = snapshot(self._cache, n) if storable(self._cache) else cache_kinds.freeze(self._cache)
        return (Piece(b.scope, list(b.tokens), self.lo, self.hi, layers, b.inflight),
                Boundary(b.scope, list(b.tokens), self.hi, hidden, b.inflight))


def rebuild(stage: Stage, lo: int, hi: int, inputs: list[Boundary], chunk: int) -> tuple[list[Piece], list[Boundary]]:
    """Rebuild ``[lo, hi)`` for every usable input at once (worker thread): the KV pieces
    and the states entering ``hi``, in the inputs' order (see :class:`Rebuild`)."""
    pieces: list[Piece] = []
    outputs: list[Boundary] = []
    for given in inputs:
        job = Rebuild(stage, lo, hi, given, chunk)
        if job.fed != job.total or job.total == 0:  # states of another length than the tokens
            continue
        while job.step() is not None:
            pass
        if (made := job.result()) is not None:
            pieces.append(made[0])
            outputs.append(made[1])
    return pieces, outputs
