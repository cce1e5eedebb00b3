"""KV caches as they move between stages on a re-plan: pieces, their wire form, and
how a stage puts together the caches of its new layer range.

A :class:`Piece` is the KV of one token sequence (a request in flight, or a prefix-cache
entry) for a layer range ``[start, end)``: per layer, keys and values
``(1, kv_heads, tokens, head_dim)``. After a re-plan a stage holds pieces of its own
(the layers it kept) and pieces it fetched from the layers' previous holders;
:func:`assemble` joins them layer range to layer range into sequences that cover the
stage's new range.

Joining pieces of different sequences is exact on their common prefix: attention is
causal, so the KV of layer ``l`` for tokens ``t[:n]`` depends only on ``t[:n]``
(Vaswani et al. 2017, masked self-attention). Two stages of one request may also have
parked it one decode step apart; the joined piece keeps the tokens both hold.

A piece may instead hold whole cache states (:class:`.cache_kinds.Frozen`: sliding
windows, recurrent states), exact at its length only: it joins only sequences of exactly
its tokens and never goes on the wire (``FetchKV`` leaves it out:
:func:`.kv_handoff.declined`); it serves the node that parked or rebuilt it.

Pure MLX array handling, run on the engine's worker thread; no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ringlet.daemon.engine import cache_kinds
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


class KVPieceError(ValueError):
    """Chunks that do not form a piece: a missing layer, shapes or dtypes that disagree."""


@dataclass
class Piece:
    """The KV of ``tokens`` for layers ``[start, end)``.

    Attributes:
        scope: the prefix cache scope the sequence belongs to.
        tokens: its token ids, one per cached position.
        start, end: the layer range (half-open).
        layers: per layer of the range, ``(keys, values)``, each
            ``(1, kv_heads, len(tokens), head_dim)``; or whole states
            (:class:`.cache_kinds.Frozen`) when :attr:`exact`.
        inflight: a request in flight when the plan changed (else a prefix-cache entry).
    """

    scope: str
    tokens: list[int]
    start: int
    end: int
    layers: list[tuple[mx.array, mx.array]]
    inflight: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (or states)."""
        return cache_kinds.layers_nbytes(self.layers)

    @property
    def exact(self) -> bool:
        """It holds whole states: usable at exactly ``len(tokens)`` only."""
        return cache_kinds.frozen(self.layers)

    def within(self, start: int, end: int) -> Piece | None:
        """This piece's layers inside ``[start, end)`` (``None``: none are)."""
        lo, hi = max(start, self.start), min(end, self.end)
        if lo >= hi:
            return None
        return Piece(self.scope, self.tokens, lo, hi, self.layers[lo - self.start:hi - self.start], self.inflight)

    def outside(self, start: int, end: int) -> list[Piece]:
        """This piece's layers outside ``[start, end)``: up to two pieces."""
        return [self.within(lo, hi) for lo, hi in range_minus((self.start, self.end), (start, end))]

    def truncated(self, n: int) -> Piece:
        """The first ``n`` tokens of this piece (compact copies)."""
        if n >= len(self.tokens):
            return self
        layers = [(mx.contiguous(k[..., :n, :]), mx.contiguous(v[..., :n, :])) for k, v in self.layers]
        return Piece(self.scope, self.tokens[:n], self.start, self.end, layers, self.inflight)


def range_minus(whole: tuple[int, int], held: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The parts of the half-open range ``whole`` outside ``held`` (``None``: nothing
    held): up to two ranges, in order."""
    start, end = whole
    if held is None or held[1] <= start or held[0] >= end:
        return [(start, end)] if start < end else []
    return [r for r in ((start, held[0]), (held[1], end)) if r[0] < r[1]]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def assemble(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """Sequences covering layers ``[start, end)``, joined from ``pieces``.

    For each piece that covers layer ``start`` (an anchor), the layers that follow are
    taken, range after range, from the piece of the same scope sharing the longest
    token prefix with the anchor (a request in flight before an entry, on a tie). The
    result holds the tokens every joined piece shares; a sequence some layer lacks, or
    whose pieces share no token, is left out. Several anchors that come to the same
    tokens give one result (the first).

    Returns:
        Pieces over exactly ``[start, end)``, each with at least one token.
    """
    done: set[tuple[str, tuple[int, ...]]] = set()
    out: list[Piece] = []
    anchors = sorted((p for p in pieces if p.start <= start < p.end), key=lambda p: (not p.inflight, -len(p.tokens)))
    for anchor in anchors:
        chosen: list[Piece] = []
        n = len(anchor.tokens)
        at = start
        while at < end:
            if anchor.start <= at < anchor.end:
                best = anchor
            else:
                candidates = [p for p in pieces if p.scope == anchor.scope and p.start <= at < p.end]
                best = max(candidates, key=lambda p: (common_prefix(p.tokens, anchor.tokens), p.inflight),
                           default=None)
            if best is None:
                break
            n = min(n, common_prefix(best.tokens, anchor.tokens))
            piece = best.within(at, end)
            chosen.append(piece)
            at = piece.end
        key = (anchor.scope, tuple(anchor.tokens[:n]))
        if at < end or n == 0 or key in done or any(p.exact and len(p.tokens) != n for p in chosen):
            continue  # (a whole state cannot be cut to fewer tokens)
        done.add(key)
        layers = [layer for p in chosen for layer in p.truncated(n).layers]
        # a sequence in flight on any stage is a request in flight (pinned until it resumes)
        out.append(Piece(anchor.scope, anchor.tokens[:n], start, end, layers, any(p.inflight for p in chosen)))
    return out


# --- wire form -----------------------------------------------------------------------------


def token_digest(tokens: list[int]) -> bytes:
    """sha256 of token ids as little-endian int32: names a sequence's prefix on the wire
    (``KVHave``) without sending its ids back."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).digest()


def held_prefix(piece: Piece, have: list[pb.KVHave]) -> int:
    """How many of ``piece``'s leading tokens the caller says it holds (0: none)."""
    best = 0
    for h in have:
        if h.scope == piece.scope and best < h.tokens <= len(piece.tokens) and \
                token_digest(piece.tokens[:h.tokens]) == h.digest:
            best = h.tokens
    return best


def to_chunks(pieces: list[Piece], max_bytes: int, held: list[int] | None = None) -> Iterator[pb.KVChunk]:
    """The wire form of ``pieces``: per piece and layer, one chunk of keys and values,
    split along the tokens so that no chunk's tensors exceed ``max_bytes`` together.
    ``held[i]``: the caller holds piece ``i``'s first tokens already; only the others are
    sent (a piece it holds whole is one chunk with its ids and no tensors)."""
    for index, piece in enumerate(pieces):
        first = True
        skip = held[index] if held else 0
        n = len(piece.tokens)
        if skip >= n:
            yield _head(pb.KVChunk(piece=index, layer=piece.start), piece, skip)
            continue
        for layer, (k, v) in enumerate(piece.layers, start=piece.start):
            per_token = max(1, (k.nbytes + v.nbytes) // max(1, n))
            step = max(1, max_bytes // per_token)
            for t in range(skip, n, step):
                chunk = pb.KVChunk(piece=index, layer=layer, token_start=t,
                                   keys=codec.encode(k[..., t:t + step, :]),
                                   values=codec.encode(v[..., t:t + step, :]))
                if first:
                    _head(chunk, piece, skip)
                    first = False
                yield chunk


def _head(chunk: pb.KVChunk, piece: Piece, held: int) -> pb.KVChunk:
    """``chunk`` as the first of ``piece``: its scope, ids, in-flight flag and held tokens."""
    chunk.scope, chunk.inflight, chunk.from_token = piece.scope, piece.inflight, held
    chunk.tokens.extend(piece.tokens)
    return chunk


class PieceReader:
    """Rebuilds pieces from :func:`to_chunks`' chunks of layers ``[start, end)``.

    Args:
        start, end: the layer range asked for: every piece must hold all of it.
        dtype: the cache dtype of the receiving stage (``None``: any float dtype).
        max_bytes: the largest tensor a chunk may carry.
        held: pieces of ``[start, end)`` the caller already holds (a snapshot taken while
            it prepared): a piece that comes ``from_token`` n takes its first n tokens'
            KV from the held piece with its scope and those n token ids.
    """

    def __init__(self, start: int, end: int, dtype: mx.Dtype | None, max_bytes: int,
                 held: list[Piece] | None = None):
        self.start, self.end, self.dtype, self.max_bytes = start, end, dtype, max_bytes
        self._meta: dict[int, tuple[str, list[int], bool]] = {}
        self._parts: dict[tuple[int, int], list[tuple[int, mx.array, mx.array]]] = {}
        self._held = list(held or [])
        self.nbytes = 0

    def _seed(self, chunk: pb.KVChunk) -> None:
        """Take a sequence's first ``from_token`` tokens from the held pieces.

        Raises:
            KVPieceError: no held piece has them.
        """
        n, tokens = chunk.from_token, list(chunk.tokens)
        for p in self._held:
            if p.scope == chunk.scope and p.start <= self.start and p.end >= self.end and \
                    p.tokens[:n] == tokens[:n] and len(p.tokens) >= n:
                for layer, (k, v) in enumerate(p.within(self.start, self.end).layers, start=self.start):
                    self._parts.setdefault((chunk.piece, layer), []).append((0, k[..., :n, :], v[..., :n, :]))
                return
        raise KVPieceError(f"piece {chunk.piece}: from token {n}, but no piece held here has those tokens")

    def add(self, chunk: pb.KVChunk) -> None:
        """Take one chunk.

        Raises:
            KVPieceError: a layer outside the range, a tensor that is malformed, of
                another dtype, or whose shape disagrees with its values or tokens.
        """
        if chunk.tokens or chunk.piece not in self._meta:
            self._meta[chunk.piece] = (chunk.scope, list(chunk.tokens), chunk.inflight)
            if chunk.from_token:
                self._seed(chunk)
        if not self.start <= chunk.layer < self.end:
            raise KVPieceError(f"layer {chunk.layer} is outside the range [{self.start}, {self.end}) asked for")
        if not chunk.HasField("keys") and not chunk.HasField("values") and chunk.from_token:
            return  # the caller holds the whole sequence
        try:
            k = codec.decode(chunk.keys, max_bytes=self.max_bytes, require_finite=True)
            v = codec.decode(chunk.values, max_bytes=self.max_bytes, require_finite=True)
        except codec.TensorDecodeError as exc:
            raise KVPieceError(f"piece {chunk.piece}, layer {chunk.layer}: {exc}") from None
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != 1 or k.shape[:3] != v.shape[:3]:
            raise KVPieceError(f"piece {chunk.piece}, layer {chunk.layer}: keys {tuple(k.shape)} and values "
                               f"{tuple(v.shape)} are not (1, kv_heads, tokens, head_dim) of one length")
        # (a layer that caches nothing holds keys of width 0: no value to be of another dtype, cacheless.py)
        if self.dtype is not None and k.size and (k.dtype != self.dtype or v.dtype != self.dtype):
            raise KVPieceError(f"piece {chunk.piece}, layer {chunk.layer}: dtype {k.dtype}, this stage caches "
                               f"{self.dtype}")
        self._parts.setdefault((chunk.piece, chunk.layer), []).append((chunk.token_start, k, v))
        self.nbytes += k.nbytes + v.nbytes

    def pieces(self) -> list[Piece]:
        """The pieces received, each over ``[start, end)``.

        Raises:
            KVPieceError: a piece lacks a layer or some of its tokens.
        """
        out = []
        for index, (scope, tokens, inflight) in sorted(self._meta.items()):
            layers = []
            for layer in range(self.start, self.end):
                parts = sorted(self._parts.get((index, layer), []), key=lambda p: p[0])
                if not parts:
                    raise KVPieceError(f"piece {index} lacks layer {layer}")
                k = mx.concatenate([p[1] for p in parts], axis=2) if len(parts) > 1 else parts[0][1]
                v = mx.concatenate([p[2] for p in parts], axis=2) if len(parts) > 1 else parts[0][2]
                if k.shape[2] != len(tokens) or [p[0] for p in parts] != _starts(parts):
                    raise KVPieceError(f"piece {index}, layer {layer}: {k.shape[2]} cached tokens for "
                                       f"{len(tokens)} token ids")
                layers.append((k, v))
            out.append(Piece(scope, tokens, self.start, self.end, layers, inflight))
        return out


def _starts(parts: list[tuple[int, mx.array, mx.array]]) -> list[int]:
    """The token offsets at which consecutive parts must start (each after the last)."""
    starts, at = [], 0
    for _, k, _ in parts:
        starts.append(at)
        at += k.shape[2]
    return starts
