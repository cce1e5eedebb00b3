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

:class:`Speculation` is one request's draft length, which adapts to its acceptance:
up by one after a draft accepted whole, halved after a draft rejected whole, and after
``BACKOFF`` drafts in a row rejected whole, no draft for a growing number of steps
(a story, whose repeats are rare, costs almost nothing). Pure Python, no MLX.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterable, Sequence
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
class Speculation:
    """One request's adaptive draft length and its figures.

    The length goes up by one after a draft accepted whole, to one more than the
    accepted part after a partial one, halves after one rejected whole; after
    :data:`BACKOFF` of those in a row, no draft for 8, 16, ... 128 steps. And where
    trips are measured, the request drafts the length (at most that) whose expected
    tokens beat what such a trip costs, or none (:meth:`allowance`).

    Args:
        limit: the most tokens drafted per step (>= 1).

    Attributes:
        k: the draft length the next step may use.
        drafted, accepted: drafted tokens sent to be verified, and those accepted.
        trips: verifying steps around the ring; tokens: tokens they produced.
    """

    limit: int
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    trips: int = 0
    tokens: int = 0
    _misses: int = 0
    #: decayed [accepted drafts, rejections] over all trips (acceptance_estimate)
    _pooled: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _pause: int = 0  # steps left without a draft
    _pauses: int = 0
    _steps: int = 0
    _since_trip: int = 0  # steps since the last verifying trip
    #: per evidence (:attr:`Drafter.evidence`): decayed [accepted drafts, rejections]
    _by: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    #: drafts in a row rejected whole before pausing
    BACKOFF = 2

    def __post_init__(self) -> None:
        self.k = self.limit

    #: while drafts do not pay, a verifying trip every this many steps still drafts, to measure again
    PROBE = 16

    def allowance(self, cost: Callable[[int], float | None] | None = None,
                  evidence: tuple[str, int] | None = None) -> int:
        """Tokens the next step may draft; counts the step. 0 while paused. Without
        ``cost`` (drafts on every step): the adaptive length :attr:`k`. With ``cost``
        (``cost(j)``: a verifying trip of ``j`` drafts in plain trips, :meth:`TripMeter.cost`;
        ``None`` where not yet measured): the length ``j <= k`` that maximises the
        expected tokens per trip over its cost, ``(1 - a^(j+1)) / (1 - a) / cost(j)`` for
        this request's per-token acceptance ``a`` of drafts on the same ``evidence``
        (:meth:`acceptance_for`; a 5-token match is likelier right than a 2-token one;
        evidence never tried yet is tried at :attr:`k`), Leviathan et al. 2023
        (arXiv:2211.17192) §3.4 eq. 1 and the walltime improvement of §3.5, when that beats
        a plain trip (> 1); else no draft, but a full-length probe once :data:`PROBE` steps went by
        without a verifying trip -- offered on every step until the drafter has a draft
        and one goes (a probe on a step where the drafter has nothing measures nothing)."""
        self._steps += 1
        self._since_trip += 1
        if self._pause > 0:
            self._pause -= 1
            return 0
        if cost is None or self.trips == 0 or (evidence and evidence[0] and evidence not in self._by):
            return self.k
        best, value = 0, 1.0
        for j in range(1, self.k + 1):
            c = cost(j)
            if c is None:
                return self.k  # not measured at this length yet: draft to measure it
            gain = expected_tokens(self.acceptance_for(evidence), j) / c
            if gain > value:
                best, value = j, gain
        if best:
            return best
        # not paying: a probe at full length, to measure what the drafter gives now (at the
        # short length the misses left, a probe could never show a trip paying)
        return self.limit if self._since_trip >= self.PROBE else 0

    @property
    def acceptance_estimate(self) -> float:
        """This request's per-token acceptance, recent trips weighted most: accepted
        drafts over accepted drafts plus rejections (a trip that stopped short is one
        rejection; the geometric model of Leviathan et al. §3.1), each trip's counts
        decayed by :data:`DECAY` per later trip; 0.5 before any trip."""
        acc, rej = self._pooled
        return acc / (acc + rej) if acc + rej > 0 else 0.5

    #: how much a trip's acceptance counts one trip later
    DECAY = 0.7

    def acceptance_for(self, evidence: tuple[str, int] | None) -> float:
        """The per-token acceptance of this request's drafts on ``evidence`` (their source
        and match length, :attr:`Drafter.evidence`), counted and decayed as
        :attr:`acceptance_estimate` over those trips alone; that estimate while they
        weigh less than one trip."""
        acc, rej = self._by.get(evidence, (0.0, 0.0)) if evidence and evidence[0] else (0.0, 0.0)
        return acc / (acc + rej) if acc + rej >= 1.0 else self.acceptance_estimate

    def verified(self, drafted: int, accepted: int, evidence: tuple[str, int] | None = None) -> None:
        """A step drafted ``drafted`` tokens on ``evidence`` and the model accepted
        ``accepted`` of them."""
        self.drafted += drafted
        self.accepted += accepted
        self.trips += 1
        self._since_trip = 0
        buckets = [self._pooled]
        if evidence and evidence[0]:
            buckets.append(self._by.setdefault(evidence, [0.0, 0.0]))
        for counts in buckets:
            counts[0] = counts[0] * self.DECAY + accepted
            counts[1] = counts[1] * self.DECAY + (1 if accepted < drafted else 0)
        self.tokens += accepted + 1
        if accepted == drafted:  # (a full-length probe may have drafted more than k)
            self.k = min(self.limit, max(self.k, drafted) + 1)
            self._misses = 0
            self._pauses = 0
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self._misses += 1
            if self._misses >= self.BACKOFF:
                self._pauses += 1
                self._pause = 4 << min(self._pauses, 5)  # 8, 16, ... 128 steps
                self._misses = 0
        else:
            self.k = max(1, min(self.limit, accepted + 1))
            self._misses = 0

    @property
    def rejected(self) -> int:
        """Drafted tokens the model rejected."""
        return self.drafted - self.accepted


def next_drafts(drafter: Drafter, spec: Speculation, output: Sequence[int], room: int, stop_ids: Container[int],
                meter: TripMeter | None = None) -> tuple[list[int], int]:
    """A request's drafts for its next decode step, and how many it may draft.

    Args:
        drafter, spec: the request's :class:`Drafter` and :class:`Speculation`.
        output: its tokens generated so far (the drafter has been given them).
        room: the most tokens the step may draft (``max_tokens`` less the tokens so far
            and the step's own next token).
        stop_ids: stop tokens: drafts end before the first (the model's own draw decides a stop).
        meter: where verifying steps are measured (:class:`TripMeter`): a plain step when it
            wants one, and the draft length weighed against its cost; ``None``: drafts on
            every step at the adaptive length.

    Returns:
        ``(drafts, k)``: the drafted tokens (``drafter.evidence`` says what they rest on)
        and the allowance ``k`` they were cut to (a draft model may fill it when the
        drafter had none).
    """
    if meter is not None and meter.wants_plain():
        return [], 0
    proposal = drafter.propose(output, spec.limit)
    k = min(spec.allowance(meter.cost if meter is not None else None, drafter.evidence), room)
    drafts = proposal[:k] if k > 0 else []
    return drafts[:next((i for i, t in enumerate(drafts) if t in stop_ids), len(drafts))], k


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verifying trip of ``drafts`` drafts gives on average when each draft is
    accepted with probability ``acceptance`` until the first rejection (the accepted ones
    and the model's own next token): ``(1 - a^(k+1)) / (1 - a)``, Leviathan et al. 2023
    (arXiv:2211.17192) eq. 1; ``k + 1`` at ``a = 1``."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


@dataclass
class TripMeter:
    """What a verifying trip around the ring costs at one stage 0, measured: the
    seconds of a decode trip without drafts, and with ``j`` drafts for each ``j``
    (exponential moving averages over trips made while this request was the only one
    decoding here).

    On a GPU a forward of k + 1 positions reads the weights once and costs about one
    decode step; on a CPU more (1.6-1.8 steps for 7 positions here, on the few-row
    kernel), and the trip's other work adds to it. :meth:`cost` gives a trip of ``j``
    drafts in plain trips, which :meth:`Speculation.allowance` weighs against the
    tokens it expects.
    """

    plain_s: float | None = None
    draft_s: dict[int, float] = field(default_factory=dict)
    _asked: int = 0

    #: weight of the newest trip in the averages
    ALPHA = 0.2

    def observe(self, drafted: int, seconds: float) -> None:
        """A decode trip that carried ``drafted`` drafts took ``seconds``."""
        if drafted:
            old = self.draft_s.get(drafted)
            self.draft_s[drafted] = seconds if old is None else old + self.ALPHA * (seconds - old)
        else:
            self.plain_s = seconds if self.plain_s is None else self.plain_s + self.ALPHA * (seconds - self.plain_s)

    #: one decode trip in this many goes without drafts, to keep ``plain_s`` measured
    PLAIN_EVERY = 32

    def wants_plain(self) -> bool:
        """Whether the next decode trip should go without drafts, to measure a plain one
        (none measured yet, or one in :data:`PLAIN_EVERY`); counts the trip."""
        self._asked += 1
        return self.plain_s is None or self._asked % self.PLAIN_EVERY == 0

    def cost(self, drafts: int | None = None) -> float | None:
        """A verifying trip of ``drafts`` drafts in plain trips (``None``: of the most
        drafts measured, as ``/v1/cluster`` shows it). A length not measured yet is
        taken on the line from a plain trip (1 at 0 drafts) through the nearest measured
        length, as the forward's cost grows about linearly with its positions; ``None``
        until a plain trip and some verifying trip are measured."""
        if self.plain_s is None or self.plain_s <= 0 or not self.draft_s:
            return None
        if drafts is None:
            drafts = max(self.draft_s)
        if drafts in self.draft_s:
            return self.draft_s[drafts] / self.plain_s
        near = min(self.draft_s, key=lambda j: (abs(j - drafts), j))
        return 1.0 + (self.draft_s[near] / self.plain_s - 1.0) * drafts / near


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
        self.trips += 1
        self.tokens += accepted + 1
        self.drafted += drafted
        self.accepted += accepted

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
