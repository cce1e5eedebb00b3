"""Drafts for speculative decoding, made by stage 0 from tokens it already has.

Two drafters, both free (no model runs):

* **prompt lookup** (n-gram): the last ``n`` tokens of the request (prompt, then
  output) are looked up among its earlier tokens, longest ``n`` first
  (``max_n`` down to ``min_n``); the tokens that followed their most recent earlier
  occurrence are the draft. Coding agents repeat their context (a file written back
  with an edit), so these hit often. The idea is "prompt lookup decoding" (Saxena 2023)
  as in vLLM's ``[ngram]`` speculator; the index here is built incrementally, one
  dictionary entry per n and token, so each step's lookup is O(max_n).
* **prediction** (OpenAI's Predicted Outputs): the text the caller expects, as token
  ids. While the output follows it, the draft is its continuation; where the output
  departs from it (an edit, or a preamble before it), the output's last tokens are
  looked up in it (from ``min_n`` = 2 tokens) at their *first* occurrence at or after
  where the output last agreed with it: the output walks through a prediction in
  order, and a file repeats its lines, so the latest occurrence (prompt lookup's rule)
  would jump to the last copy of a repeated line, or to the closing fence of a code block
  when the output opens one. A place found is where the output agrees only once the
  output's next tokens follow it there; a lookup that found a wrong place moves nothing.

How many of a drafter's tokens go on each step is :mod:`ringlet.daemon.engine.draft_length`'s.
:class:`SpecTotals` are a stage 0's figures. Pure Python, no MLX.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Default most tokens drafted per step (``--spec-tokens``).
DEFAULT_SPEC_TOKENS = 6


class NgramIndex:
    """Where each n-gram (``min_n`` <= n <= ``max_n``) of a token sequence last occurred
    with at least one token after it.

    Args:
        min_n, max_n: the n-gram lengths indexed, tokens (1 <= min_n <= max_n).
        every: also keep every occurrence (for :meth:`first_after`).
    """

    def __init__(self, min_n: int, max_n: int, every: bool = False):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after it
        #: n-gram -> every position of the token after it, ascending (``every`` only)
        self._all: dict[tuple[int, ...], list[int]] | None = {} if every else None
        #: the n-gram length of the latest :meth:`propose` match (0: none)
        self.matched = 0

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the sequence."""
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the n-grams ending just before the new token now have a follower
            for n in range(self.min_n, self.max_n + 1):
                if end - n < 0:
                    break
                key = tuple(seq[end - n:end])
                self._last[key] = end
                if self._all is not None:
                    self._all.setdefault(key, []).append(end)

    def after(self, tail: Sequence[int]) -> int | None:
        """The position following the most recent occurrence of ``tail`` (a tuple of
        ``min_n``..``max_n`` tokens); ``None`` when it never occurred with a follower."""
        return self._last.get(tuple(tail))

    def first_after(self, tail: Sequence[int], at_least: int = 0) -> int | None:
        """The position following the first occurrence of ``tail`` that starts at or
        after ``at_least``, or ``None``.

        Raises:
            ValueError: the index was built without ``every``.
        """
        if self._all is None:
            raise ValueError("this index keeps only the latest occurrence of each n-gram")
        positions = self._all.get(tuple(tail)) or []
        i = bisect.bisect_left(positions, at_least + len(tail))
        return positions[i] if i < len(positions) else None

    def propose(self, context: Sequence[int], k: int, at_least: int | None = None) -> tuple[list[int], int | None]:
        """Up to ``k`` tokens following the longest indexed n-gram that ends ``context``,
        and the position in this sequence where they start (``None``: no match): its
        latest occurrence (:meth:`after`), or with ``at_least`` its first starting at or
        after that position (:meth:`first_after`)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            tail = context[len(context) - n:]
            pos = self.after(tail) if at_least is None else self.first_after(tail, at_least)
            if pos is not None:
                self.matched = n
                return self.tokens[pos:pos + k], pos
        self.matched = 0
        return [], None


@dataclass
class Drafter:
    """One request's drafts: the caller's prediction when given, else prompt lookup over
    its prompt and output, else (with ``--draft-model``) the draft model's greedy tokens.

    Args:
        prompt: the prompt's token ids.
        prediction: the expected output's token ids (empty: none).
        min_n, max_n: prompt lookup's n-gram lengths.
        model: the request's draft-model session
            (:class:`~ringlet.daemon.engine.draft_model.DraftSession`), or ``None``. It
            runs MLX, so :meth:`propose` never calls it: the caller runs
            :meth:`propose_by_model` where the stage's forwards run.
    """

    prompt: Sequence[int]
    prediction: Sequence[int] = ()
    min_n: int = 3
    max_n: int = 5
    model: Any = None
    _own: NgramIndex = field(init=False)
    _pred: NgramIndex | None = field(init=False, default=None)
    _synced: tuple[int, int | None] = field(init=False, default=(0, 0))  # (output length, prediction position)
    _floor: int = field(init=False, default=0)  # the prediction position where the output last agreed
    #: what the latest proposal rests on (:meth:`propose`), the key of its acceptance in :class:`Speculation`
    evidence: tuple[str, int] = field(init=False, default=("", 0))
    #: per source, its proposals rejected whole in a row
    _missed: dict[str, int] = field(init=False, default_factory=lambda: {"prediction": 0, "lookup": 0})

    def __post_init__(self) -> None:
        self._own = NgramIndex(self.min_n, self.max_n)
        self._own.extend(self.prompt)
        if self.prediction:
            self._pred = NgramIndex(2, self.max_n, every=True)
            self._pred.extend(self.prediction)

    def add(self, tokens: Iterable[int]) -> None:
        """The output's new tokens."""
        self._own.extend(tokens)

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafted tokens to follow ``output`` (the tokens generated so far,
        the same as given to :meth:`add`); ``[]`` for none. The prediction's, unless its
        proposals were rejected whole more times in a row than prompt lookup's (the
        model is not writing what the caller predicted: a model that describes a file
        instead of editing it still repeats its own sentences) and prompt lookup has one."""
        if k <= 0:
            return []
        predicted, found_by = self._from_prediction(output, k) if self._pred is not None else ([], 0)
        looked_up, _ = self._own.propose(self._own.tokens, k)
        if predicted and not (looked_up and self._missed["prediction"] > self._missed["lookup"]):
            self.evidence = ("prediction", found_by)
            return predicted
        self.evidence = ("lookup", self._own.matched) if looked_up else ("model", 0) if self.model else ("", 0)
        return looked_up

    def verified(self, accepted: int) -> None:
        """The latest proposal went to be verified and the model accepted ``accepted`` of
        its tokens."""
        source = self.evidence[0]
        if source in self._missed:
            self._missed[source] = 0 if accepted else self._missed[source] + 1

    def propose_by_model(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafts from the draft model to follow the prompt and ``output``
        (``[]`` without one). Runs MLX: call it on the thread of the stage's forwards."""
        if self.model is None or k <= 0:
            return []
        return self.model.propose([*self.prompt, *output], k)

    def _from_prediction(self, output: Sequence[int], k: int) -> tuple[list[int], int]:
        """The prediction's tokens after the place the output has reached in it: the
        same place moved on while the output follows it (the output then agrees with it
        there), else found again by n-gram, first at or after where it last agreed; and
        how it was found (0: followed, else the n-gram's length)."""
        pred = self._pred.tokens
        n0, p0 = self._synced
        n = len(output)
        found_by = 0
        if p0 is not None and pred[p0:p0 + n - n0] == list(output[n0:n]) and p0 + n - n0 <= len(pred):
            p: int | None = p0 + n - n0
            if n > n0:
                self._floor = p
        else:
            _, p = self._pred.propose(output, k, self._floor)
            found_by = self._pred.matched
        self._synced = (n, p)
        return ([] if p is None else list(pred[p:p + k])), found_by


@dataclass
class SpecTotals:
    """A stage 0's speculative decoding figures since start, for ``/v1/cluster``.

    Attributes:
        trips: verifying steps (each one trip around the ring); tokens: tokens they gave.
        drafted, accepted: drafted tokens verified, and those the model accepted.
        off: why requests or steps ran without drafts -> how many (``"sampled"`` etc.).
    """

    trips: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    off: dict[str, int] = field(default_factory=dict)

    def count(self, drafted: int, accepted: int) -> None:
        """One verifying step: ``drafted`` drafts sent, ``accepted`` of them accepted."""
        self.add(accepted, drafted - accepted, 1)

    def add(self, accepted: int, rejected: int, trips: int) -> None:
        """A request's verifying steps counted elsewhere (a tensor group's rank 0): ``trips``
        steps whose drafts the model accepted ``accepted`` and rejected ``rejected`` of."""
        self.trips += trips
        self.tokens += accepted + trips
        self.drafted += accepted + rejected
        self.accepted += accepted

    def skip(self, why: str) -> None:
        """A request (or step) ran without drafts, because of ``why``."""
        self.off[why] = self.off.get(why, 0) + 1

    def figures(self, limit: int) -> dict:
        """The JSON form: the draft limit, the counts, tokens per trip and acceptance rate."""
        return {"spec_tokens": limit, "trips": self.trips, "tokens": self.tokens, "drafted": self.drafted,
                "accepted": self.accepted,
                "tokens_per_trip": round(self.tokens / self.trips, 3) if self.trips else None,
                "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "off": dict(self.off)}
