"""A stage's KV caches across a re-plan (worker-thread functions of the engine).

At a commit, :func:`park` turns the KV the old stage holds (its requests in flight,
whose token ids it knows, and its prefix store's entries) into
:class:`~ringlet.daemon.engine.kv_pieces.Piece` s of the old layer range. The node keeps
the layers it still holds, hands the others to their new holders (``FetchKV``), and
fetches the layers it gained from their old holders. :func:`install` then joins what it
has into sequences over the new range and puts them in the prefix store. A request
resumed on the new plan finds its tokens there on every stage and prefills only the
one token its next decode step would have computed anyway.

Caches of other kinds than plain ``KVCache`` (:mod:`.cache_kinds`: sliding windows,
recurrent states) are parked whole, exact at their length: they serve this node's layers
it keeps (and join a rebuild of lost layers, :mod:`.rebuild`), but never move to another
node (``FetchKV`` leaves them out, :func:`declined`; logged, and counted in the node's
``kv_migration`` figures as ``states_not_sent``): a request whose new stage lacks them
prefills again, counted there as a resume without cached tokens.

Entries of requests in flight are pinned: the store's byte budget never evicts them,
and they are unpinned when the resumed request takes them (or at the next re-plan).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ringlet.daemon.engine import cache_kinds, speculation
from ringlet.daemon.engine.boundary import Boundary, BoundaryStore
from ringlet.daemon.engine.kv_pieces import Piece, assemble
from ringlet.daemon.engine.prefix_store import PrefixStore, snapshot, storable

log = logging.getLogger(__name__)


@dataclass
class Installed:
    """What :func:`install` put in the store: sequences (of them, requests in flight),
    their tokens (of them, the requests in flight's) and bytes, and the pieces left out
    (no full cover of the range)."""

    sequences: int = 0
    inflight: int = 0
    tokens: int = 0
    inflight_tokens: int = 0
    nbytes: int = 0
    left_out: int = 0


def park(stage, requests: dict, store: PrefixStore, clear: bool = True) -> list[Piece]:
    """The KV ``stage`` holds as pieces of its layer range, and (``clear``) the store emptied.

    Args:
        stage: the stage being replaced (a :class:`~ringlet.daemon.engine.stage.Stage`;
            anything else, e.g. a tensor group's stage, parks nothing).
        requests: the engine's request states (``cache``, ``offset``, ``tokens``,
            ``scope``); a request whose tokens are unknown, or whose cache is not plain
            ``KVCache`` layers, is not parked.
        store: the stage's prefix store; its entries become pieces and leave it.

    Returns:
        Pieces over ``[stage.start, stage.end)``: requests in flight first.
    """
    if not hasattr(stage, "start") or getattr(stage, "prefix_store", None) is not None:
        return []
    pieces = []
    for state in requests.values():
        tokens = state.tokens
        if tokens is not None and len(tokens) == state.offset > 0 and state.cache:
            n = speculation.confirmed(state)  # a verifying step's drafts with no verdict here are left out
            layers = snapshot(state.cache, n) if storable(state.cache) else cache_kinds.freeze(state.cache)
            pieces.append(Piece(state.scope, list(tokens[:n]), stage.start, stage.end, layers, inflight=True))
    for entry in store.entries():
        if entry.start <= stage.start and entry.end >= stage.end:
            pieces.append(Piece(entry.scope, entry.tokens, entry.start, entry.end, entry.layers).within(
                stage.start, stage.end))
    if clear:
        store.clear()
    return pieces


def declined(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """``pieces`` less the ones holding whole states (they have no wire form), logged;
    layers ``[start, end)`` name them in the log."""
    kept = [p for p in pieces if not p.exact]
    left = [p for p in pieces if p.exact]
    if left:
        log.info("layers [%d, %d): %d sequence(s) hold windows or recurrent states, which do not move to another "
                 "node: requests that need them there prefill again", start, end, len(left))
    return kept


def park_boundaries(requests: dict, boundaries: BoundaryStore, new_end: int | None) -> list[Boundary]:
    """The boundary activations a stage being replaced holds (its requests in flight's,
    then its store's), all entering its old end; the store then keeps those that still
    enter the new stage's end ``new_end`` (``None``: none), the requests in flight's
    among them, so that a resumed request starts recording from them."""
    parked = [b for state in requests.values()
              if (b := boundaries.end(state.boundary, state.scope, state.tokens, inflight=True)) is not None]
    for state in requests.values():
        state.boundary = None
    parked += boundaries.entries()
    same_end = boundaries.layer == new_end
    boundaries.retain(new_end if new_end is not None else -1)
    if same_end:
        for b in parked:
            if b.inflight:
                boundaries.add(Boundary(b.scope, b.tokens, b.layer, b.hidden, released_at=time.monotonic()))
    return parked


def install(store: PrefixStore, pieces: list[Piece], start: int, end: int) -> Installed:
    """Join ``pieces`` into sequences over ``[start, end)`` (the stage's new range) and
    put them in ``store``: requests in flight pinned, entries within its budget."""
    done = Installed()
    joined = assemble(pieces, start, end)
    anchored = {id(p) for p in pieces if p.start <= start < p.end}
    done.left_out = max(0, len(anchored) - len(joined))
    for piece in joined:
        if store.adopt(piece.scope, piece.tokens, start, end, piece.layers, pinned=piece.inflight):
            done.sequences += 1
            done.inflight += piece.inflight
            done.tokens += len(piece.tokens)
            done.inflight_tokens += len(piece.tokens) if piece.inflight else 0
            done.nbytes += piece.nbytes
    return done
