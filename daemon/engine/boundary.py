"""Boundary activations: the hidden states a stage sent on to the next one, kept so that
the layers of a stage that dies can be rebuilt from them instead of prefilling every
request again.

Stage ``k`` holding ``[a, b)`` sends, for each token it computes, the hidden state that
enters layer ``b``. When the node holding ``[b, c)`` is lost, its layers' new holders
run just ``[b, c)`` over those hidden states (:func:`ringlet.daemon.engine.rebuild.rebuild`)
and get their KV back: ``(c - b) / L`` of a prefill instead of all of it. Layers outside
``[b, c)`` keep their KV (it moves with them, :mod:`ringlet.daemon.engine.kv_handoff`).

A :class:`Boundary` is the hidden states ``(1, tokens, hidden_size)`` of one token
sequence entering one layer. The engine keeps one per request in flight (grown by each
forward), and :class:`BoundaryStore` keeps those of finished or failed requests (their
KV went to the prefix store) by token ids, least recently used first, within
``--boundary-cache-bytes`` together with the ones in flight. At layer 0 the input is the
token ids themselves (``hidden`` is ``None``).

All methods run on the engine's MLX worker thread; :func:`to_chunks` and
:class:`BoundaryReader` are the wire form (``FetchBoundary``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from ringlet.daemon.engine.token_index import TokenIndex
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


class BoundaryError(ValueError):
    """Chunks that do not form boundaries: a wrong width or dtype, tokens that disagree."""


@dataclass
class Boundary:
    """The hidden states of ``tokens`` entering layer ``layer``.

    Attributes:
        scope: the prefix cache scope of the sequence.
        tokens: its token ids.
        layer: the layer these states enter (the sending stage's end).
        hidden: ``(1, len(tokens), hidden_size)``; ``None`` at layer 0 (the input is
            the token ids).
        inflight: a request in flight when the plan changed (else a finished one's).
        released_at: ``time.monotonic()`` when its request ended here (0: in flight).
    """

    scope: str
    tokens: list[int]
    layer: int
    hidden: mx.array | None
    inflight: bool = False
    released_at: float = 0.0
    id: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the hidden states."""
        return 0 if self.hidden is None else self.hidden.nbytes

    def truncated(self, n: int) -> Boundary:
        """The first ``n`` tokens' states (a compact copy)."""
        if n >= len(self.tokens):
            return self
        hidden = None if self.hidden is None else mx.contiguous(self.hidden[:, :n])
        return Boundary(self.scope, self.tokens[:n], self.layer, hidden, self.inflight, self.released_at)


@dataclass
class Recording:
    """The states one request in flight has sent on so far: ``parts`` ``(1, t, hidden)``,
    ``rows`` tokens in all, ``nbytes`` bytes. Decode steps add a row each; every
    :data:`TAIL` of them are joined into one block, so a long request holds few arrays and
    each row is copied once before :meth:`hidden`."""

    parts: list[mx.array]
    rows: int = 0
    nbytes: int = 0
    blocks: int = 0  # leading parts already joined

    TAIL = 64

    def add(self, out: mx.array) -> None:
        self.parts.append(out)
        if len(self.parts) - self.blocks >= self.TAIL:
            self.parts[self.blocks:] = [mx.concatenate(self.parts[self.blocks:], axis=1)]
            self.blocks += 1

    def hidden(self) -> mx.array:
        """All of them as one array ``(1, rows, hidden_size)``."""
        if len(self.parts) > 1:
            self.parts = [mx.concatenate(self.parts, axis=1)]
            self.blocks = 1
        return self.parts[0]


class BoundaryStore(TokenIndex):
    """The boundary activations of finished requests at one stage's end, by token ids.

    Args:
        budget_bytes: the most bytes it and the requests in flight hold together
            (``--boundary-cache-bytes``; 0 keeps none).
        layer: the layer its states enter (the stage's end).
    """

    def __init__(self, budget_bytes: int, layer: int = 0):
        super().__init__(budget_bytes)
        self.layer = layer
        #: bytes of the requests in flight's states, counted against the same budget
        self.inflight_bytes = 0
        self.evictions = 0
        #: requests in flight whose states no longer fit (they would fall back to a full prefill)
        self.dropped = 0

    def _room_for(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` more of a request in flight, evicting finished ones
        (oldest first); whether they fit."""
        self._evict_to(max(0, self.budget_bytes - self.inflight_bytes - nbytes))
        return self.inflight_bytes + self.nbytes + nbytes <= self.budget_bytes

    # --- requests in flight (the engine's hooks) -------------------------------------------

    def begin(self, scope: str, prefix: list[int]) -> Recording | None:
        """A request starts here; its first ``len(prefix)`` tokens come from the prefix
        store. Returns its recording (seeded with the states of ``prefix`` when this store
        has them), or ``None``: its states will not be complete (no budget, or the
        prefix's states are not here), so its layers downstream cannot be rebuilt."""
        if self.budget_bytes <= 0:
            return None
        if not prefix:
            return Recording([])
        found = self.find(scope, prefix)
        if found is None or found.hidden is None or not self._room_for(found.nbytes):
            return None
        self.inflight_bytes += found.nbytes
        return Recording([found.hidden], len(prefix), found.nbytes)

    def record(self, recording: Recording | None, out: mx.array) -> Recording | None:
        """Add the states ``out`` ``(1, t, hidden)`` a forward sent on; ``None`` (and the
        request counted in :attr:`dropped`) when they no longer fit."""
        if recording is None:
            return None
        if not self._room_for(out.nbytes):
            self.end(recording)
            self.dropped += 1
            return None
        recording.add(out)
        recording.rows += out.shape[1]
        recording.nbytes += out.nbytes
        self.inflight_bytes += out.nbytes
        return recording

    def cut(self, recording: Recording, rows: int) -> None:
        """Keep only the first ``rows`` states of ``recording`` (drafted positions the
        model rejected, :mod:`.speculation`)."""
        parts = recording.parts
        while recording.rows > rows and parts:
            last = parts[-1]
            drop = min(last.shape[1], recording.rows - rows)
            kept = last[:, :last.shape[1] - drop]
            self.inflight_bytes -= last.nbytes - kept.nbytes
            recording.nbytes -= last.nbytes - kept.nbytes
            recording.rows -= drop
            if kept.shape[1]:
                parts[-1] = kept
            else:
                parts.pop()
        recording.blocks = min(recording.blocks, len(parts))

    def end(self, recording: Recording | None, scope: str = "", tokens: list[int] | None = None,
            inflight: bool = False) -> Boundary | None:
        """The request's recording ends (released, or parked at a re-plan). With
        ``tokens`` (its tokens, at least as many as recorded), its states become a
        :class:`Boundary`: kept in the store when ``inflight`` is false, returned either way."""
        if recording is None:
            return None
        self.inflight_bytes -= recording.nbytes
        if tokens is None or recording.rows == 0 or len(tokens) < recording.rows:
            return None
        boundary = Boundary(scope, list(tokens[:recording.rows]), self.layer, recording.hidden(), inflight,
                            released_at=0.0 if inflight else time.monotonic())
        if not inflight:
            self.add(boundary)
        return boundary

    def _evict(self, entry: Boundary) -> None:
        self.evictions += 1
        self._forget(entry)

    def add(self, boundary: Boundary) -> bool:
        """Keep ``boundary`` (at :attr:`layer`) as the most recently used; entries it
        extends go. Returns whether it fits the budget."""
        if boundary.layer != self.layer or boundary.nbytes + self.inflight_bytes > self.budget_bytes:
            return False
        self._forget_prefixes_of(boundary.scope, boundary.tokens)
        self._evict_to(self.budget_bytes - self.inflight_bytes - boundary.nbytes)
        boundary.id = next(self._ids)
        self._add(boundary)
        return True

    def find(self, scope: str, tokens: list[int]) -> Boundary | None:
        """The states of exactly ``tokens`` (from an entry holding them or a longer
        sequence that starts with them), or ``None``."""
        for entry, n in self._candidates(scope, tokens):
            if n == len(tokens):
                self._entries.move_to_end(entry.id)
                return entry.truncated(n)
        return None

    def entries(self) -> list[Boundary]:
        """Every entry, least recently used first."""
        return list(self._entries.values())

    def retain(self, layer: int) -> None:
        """The stage now ends at ``layer``: entries of another layer go."""
        if layer != self.layer:
            self.clear()
            self.layer = layer

    def figures(self) -> dict:
        """For ``/v1/cluster``: budget, bytes held (finished and in flight), entries,
        evictions, requests in flight whose states did not fit."""
        return {"budget_bytes": self.budget_bytes, "bytes": self.nbytes + self.inflight_bytes,
                "inflight_bytes": self.inflight_bytes, "entries": len(self), "layer": self.layer,
                "evictions": self.evictions, "dropped": self.dropped}


# --- wire form -----------------------------------------------------------------------------


def to_chunks(boundaries: list[Boundary], max_bytes: int) -> Iterator[pb.BoundaryChunk]:
    """The wire form of ``boundaries``: per sequence, its hidden states split along the
    tokens so that no chunk's tensor exceeds ``max_bytes``; a sequence's first chunk
    carries its scope and token ids (at layer 0, that chunk is all there is)."""
    for index, b in enumerate(boundaries):
        yield head_chunk(index, b)
        if b.hidden is not None:
            yield from part_chunks(index, b.layer, 0, b.hidden, max_bytes)


def head_chunk(index: int, b: Boundary) -> pb.BoundaryChunk:
    """The first chunk of sequence ``index``: its scope and token ids, no states."""
    head = pb.BoundaryChunk(sequence=index, scope=b.scope, inflight=b.inflight, layer=b.layer, first=True)
    head.tokens.extend(b.tokens)
    return head


def part_chunks(index: int, layer: int, token_start: int, hidden: mx.array,
                max_bytes: int) -> Iterator[pb.BoundaryChunk]:
    """States ``(1, t, hidden_size)`` of tokens from ``token_start`` of sequence ``index``,
    in chunks of at most ``max_bytes``."""
    n = hidden.shape[1]
    step = max(1, max_bytes // max(1, hidden.nbytes // max(1, n)))
    for t in range(0, n, step):
        chunk = pb.BoundaryChunk(sequence=index, layer=layer, token_start=token_start + t)
        chunk.hidden.CopyFrom(codec.encode(hidden[:, t:t + step]))
        yield chunk


class BoundaryReader:
    """Rebuilds boundaries from :func:`to_chunks`' chunks.

    Args:
        layer: the layer asked for.
        hidden_size: the model's width.
        dtype: the activation dtype of the receiving stage (``None``: any float dtype).
        max_bytes: the largest tensor a chunk may carry.
    """

    def __init__(self, layer: int, hidden_size: int, dtype: mx.Dtype | None, max_bytes: int):
        self.layer, self.hidden_size, self.dtype, self.max_bytes = layer, hidden_size, dtype, max_bytes
        self._meta: dict[int, tuple[str, list[int], bool]] = {}
        self._parts: dict[int, list[tuple[int, mx.array]]] = {}
        self.nbytes = 0

    def add(self, chunk: pb.BoundaryChunk) -> tuple[int, Boundary | None, int, mx.array | None]:
        """Take one chunk. Returns what it brought: ``(sequence, its scope and token ids
        as a Boundary without states on its first chunk else None, token_start, states
        (1, t, hidden_size) or None)``.

        Raises:
            BoundaryError: another layer, a malformed tensor, or one of another width or dtype.
        """
        if chunk.layer != self.layer:
            raise BoundaryError(f"a boundary at layer {chunk.layer}, asked for layer {self.layer}")
        meta = None
        if chunk.first:
            self._meta[chunk.sequence] = (chunk.scope, list(chunk.tokens), chunk.inflight)
            meta = Boundary(chunk.scope, list(chunk.tokens), self.layer, None, chunk.inflight)
        elif chunk.sequence not in self._meta:
            raise BoundaryError(f"sequence {chunk.sequence}: states before its first chunk")
        if not chunk.HasField("hidden"):
            return chunk.sequence, meta, chunk.token_start, None
        try:
            h = codec.decode(chunk.hidden, max_bytes=self.max_bytes, require_finite=True)
        except codec.TensorDecodeError as exc:
            raise BoundaryError(f"sequence {chunk.sequence}: {exc}") from None
        if h.ndim != 3 or h.shape[0] != 1 or h.shape[2] != self.hidden_size:
            raise BoundaryError(f"sequence {chunk.sequence}: hidden states {tuple(h.shape)} are not "
                                f"(1, tokens, {self.hidden_size})")
        if self.dtype is not None and h.dtype != self.dtype:
            raise BoundaryError(f"sequence {chunk.sequence}: dtype {h.dtype}, this stage computes in {self.dtype}")
        self._parts.setdefault(chunk.sequence, []).append((chunk.token_start, h))
        self.nbytes += h.nbytes
        return chunk.sequence, meta, chunk.token_start, h

    def boundaries(self) -> list[Boundary]:
        """The sequences received, each whole.

        Raises:
            BoundaryError: a sequence whose states do not cover its tokens exactly.
        """
        out = []
        for index, (scope, tokens, inflight) in sorted(self._meta.items()):
            parts = sorted(self._parts.get(index, []), key=lambda p: p[0])
            if self.layer == 0:
                out.append(Boundary(scope, tokens, 0, None, inflight))
                continue
            at = 0
            for start, h in parts:
                if start != at:
                    raise BoundaryError(f"sequence {index}: states from token {start}, expected {at}")
                at += h.shape[1]
            if at != len(tokens) or not parts:
                raise BoundaryError(f"sequence {index}: states of {at} tokens for {len(tokens)} token ids")
            hidden = parts[0][1] if len(parts) == 1 else mx.concatenate([h for _, h in parts], axis=1)
            out.append(Boundary(scope, tokens, self.layer, hidden, inflight))
        return out
