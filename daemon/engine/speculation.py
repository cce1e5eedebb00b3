"""Speculative decoding on a stage: verifying drafted tokens, and dropping the KV of
the rejected ones.

A verifying step carries the request's latest token and ``k`` drafted tokens; every
stage computes the ``k + 1`` positions in one forward (reading its weights once). The
last stage then samples each position in turn with the request's own sampler (its
penalties, grammar and seeded key, one draw per token as without drafts) and keeps
drafts while they equal the draw (:func:`verify`). The tokens it returns are the
accepted drafts then the first draw that differs (or the draw after the last draft).

Greedy, this is "the longest prefix equal to the argmax". Sampled, it is the rejection
rule of Leviathan et al. 2023 (arXiv:2211.17192, Algorithm 1) and Chen et al. 2023
(arXiv:2302.01318) for a draft distribution ``q`` that puts all its mass on the drafted
token ``d``, as both drafters here do: accept ``d`` with probability ``min(1, p(d) /
q(d)) = p(d)``, else draw from ``norm(max(0, p - q))``, which is ``p`` without ``d``.
Drawing ``x ~ p`` and accepting when ``x = d`` does exactly that: ``P(accept) = p(d)``,
and a rejection leaves ``x ~ p(x | x != d)``. So the output follows the target
distribution, and a seeded request draws the same tokens with or without drafts.

The rejected positions then leave every stage's KV cache: the last stage drops them at
once; the other stages when the request's next step arrives with a smaller offset
(:func:`roll_back`), or at its release (:func:`settle_for_release`), so the caches,
the prefix store and the boundary store keep exactly the accepted tokens. Trimming
uses mlx-lm's ``can_trim_prompt_cache`` / ``trim_prompt_cache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx


def trimmable(cache: list) -> bool:
    """Whether drafted positions can be dropped from ``cache`` exactly, whatever their
    number: every layer is mlx-lm's plain ``KVCache`` (a ``RotatingKVCache`` stops being
    trimmable once it wraps, a recurrent ``ArraysCache`` never is), or an entry that says
    it trims exactly (``trims_exactly``: a tensor group's slot, whose ranks hold plain
    ``KVCache`` s and say so in ``is_trimmable``)."""
    from mlx_lm.models.cache import KVCache, can_trim_prompt_cache

    return (bool(cache) and all(type(c) is KVCache or getattr(c, "trims_exactly", False) for c in cache)
            and can_trim_prompt_cache(cache))


def verify(sampler: Any, logits: mx.array, fed: Sequence[int], history: Sequence[int]) -> list[int]:
    """The tokens a verifying step yields: the accepted drafts, then the next token.

    Args:
        sampler: the request's :class:`~ringlet.daemon.engine.sampling.RequestSampler`.
        logits: the last stage's output for the step's positions, ``(k + 1, vocab)``.
        fed: the step's token ids ``[latest, d_1, ..., d_k]`` (``k + 1`` of them).
        history: the request's tokens before the step (prompt, then output before ``latest``).

    Returns:
        ``m + 1`` sampled tokens (``Token`` s, with their scores when asked): ``d_1..d_m``
        accepted, then the draw at position ``m``; ``0 <= m <= k``.
    """
    base = list(history)
    out = []
    for j in range(len(fed)):
        token = sampler(logits[j], [*base, *fed[:j + 1]])
        out.append(token)
        if j + 1 >= len(fed) or int(token) != int(fed[j + 1]):
            break
    return out


def finish_verify(state: Any, logits: mx.array, tokens: int, boundaries: Any) -> list[int]:
    """The last stage after a verifying step of ``tokens`` positions (already counted in
    ``state.offset``): :func:`verify` them and drop the rejected positions at once.

    Raises:
        ValueError: the step's token ids are unknown, or the cache cannot be trimmed.
    """
    floor = state.offset - tokens
    if state.tokens is None or len(state.tokens) != state.offset:
        raise ValueError("a verifying step needs its token ids")
    out = verify(state.sampler, logits[0], state.tokens[floor:], state.tokens[:floor])
    trim(state, floor + len(out), boundaries)
    state.drafted_from = None
    return out


def trim(state: Any, keep: int, boundaries: Any) -> None:
    """Drop the positions of ``state`` (a scheduler ``_RequestState``) past ``keep``
    tokens: its KV cache (mlx-lm's ``trim_prompt_cache``), its known token ids and its
    boundary recording.

    Raises:
        ValueError: the cache cannot be trimmed by that much.
    """
    from mlx_lm.models.cache import trim_prompt_cache

    drop = state.offset - keep
    if drop <= 0:
        return
    if not trimmable(state.cache) or trim_prompt_cache(state.cache, drop) != drop:
        raise ValueError(f"cannot drop {drop} drafted positions from this KV cache")
    state.offset = keep
    if state.tokens is not None:
        del state.tokens[keep:]
    if state.boundary is not None:
        boundaries.cut(state.boundary, keep)


def roll_back(state: Any, offset: int, boundaries: Any) -> bool:
    """A step arrives at ``offset`` while ``state`` holds the positions of a verifying
    step: drop those past ``offset`` when it lies within them. Returns whether it did
    (``False``: ``offset`` is not in the drafted window, a real mismatch)."""
    floor = getattr(state, "drafted_from", None)
    if floor is None or not floor < offset <= state.offset:
        return False
    trim(state, offset, boundaries)
    state.drafted_from = None
    return True


def confirmed(state: Any) -> int:
    """The leading tokens of ``state`` (a scheduler ``_RequestState``) known to be the
    request's: all of them, or while a verifying step this stage sent on awaits its
    verdict, those up to and including the fed token at ``drafted_from``."""
    floor = getattr(state, "drafted_from", None)
    return state.offset if floor is None else floor + 1


def drop_unconfirmed(state: Any, boundaries: Any) -> None:
    """Before a re-plan parks ``state`` (its KV and boundary states become pieces to
    keep or rebuild): drop the drafted positions of a verifying step this stage sent on
    whose verdict it has not seen. Only the fed token, at ``drafted_from``, is known to be
    the request's; a draft kept here would make a parked sequence that neither the
    finished turn it repeats nor the resumed request contains, so it would be rebuilt
    beside them (twice the work) and never reused. Drafts the last stage did accept are
    prefilled again on resume (at most ``k`` tokens)."""
    if getattr(state, "drafted_from", None) is None:
        return
    try:
        trim(state, confirmed(state), boundaries)
    except ValueError:  # drafts run only on caches that trim; parked as they are, they cost work, not exactness
        return
    state.drafted_from = None


def settle_for_release(state: Any, token_ids: Sequence[int] | None, boundaries: Any) -> None:
    """Before a release keeps ``state`` in the prefix store: drop the drafted positions
    ``token_ids`` (the request's tokens, as stage 0 has them) does not confirm."""
    floor = getattr(state, "drafted_from", None)
    if floor is None or not token_ids:
        return
    keep = floor + 1 if state.tokens is None else floor  # the latest token at ``floor`` is stage 0's own
    limit = min(state.offset, len(token_ids), len(state.tokens or ()))
    while keep < limit and state.tokens[keep] == token_ids[keep]:
        keep += 1
    trim(state, keep, boundaries)
    state.drafted_from = None
