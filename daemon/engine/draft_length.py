"""How many drafted tokens a request's next step carries (speculative decoding).

:class:`Speculation` is one request's draft length, which adapts to its acceptance:
up by one after a draft accepted whole, halved after a draft rejected whole, and after
``BACKOFF`` drafts in a row rejected whole, no draft for a growing number of steps
(a story, whose repeats are rare, costs almost nothing). Where trips are measured
(:class:`TripMeter`), it drafts the length whose expected tokens (:class:`RunLengths`)
beat most what a trip of that length costs, or none. :func:`next_drafts` puts a
drafter (:class:`ringlet.daemon.engine.drafting.Drafter`) and these together for one
step. Pure Python, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from ringlet.daemon.engine.drafting import Drafter


@dataclass
class RunLengths:
    """How far into its drafts the model accepts, counted by position (decayed): per
    position ``i`` (1-based, index ``i - 1``), the trips whose verdict reached it (its
    ``i - 1`` drafts before were accepted) and those rejected there. The estimate of
    Kaplan & Meier (1958, J. Am. Stat. Assoc. 53:457) for a run length: trips that
    accepted their whole draft tell that the run is at least that long, nothing more.

    Args:
        limit: the most drafts a trip carries.
    """

    limit: int
    reached: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.limit
        self.rejected = [0.0] * self.limit

    @property
    def weight(self) -> float:
        """The decayed number of trips counted."""
        return self.reached[0]

    @property
    def verdicts(self) -> float:
        """The decayed number of drafts judged: accepted ones plus rejections."""
        return sum(self.reached)

    def acceptance(self) -> float:
        """Per-token acceptance, the geometric model of Leviathan et al. §3.1: accepted
        drafts over accepted drafts plus rejections (a trip that stopped short is one
        rejection), decayed as counted; 0.5 before any verdict."""
        verdicts = self.verdicts
        return (verdicts - sum(self.rejected)) / verdicts if verdicts > 0 else 0.5

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        """One trip of ``drafted`` drafts, ``accepted`` of them accepted; earlier trips
        count ``decay`` times as much as before."""
        for counts in (self.reached, self.rejected):
            for i in range(self.limit):
                counts[i] *= decay
        for i in range(min(accepted + 1, drafted, self.limit)):
            self.reached[i] += 1.0
        if accepted < drafted <= self.limit:
            self.rejected[accepted] += 1.0

    def expected(self, drafts: int, hazard: float) -> float:
        """Tokens a trip of ``drafts`` drafts gives on average: ``1 + sum_{i <= drafts}
        S(i)``, with ``S(i) = prod_{l <= i} (1 - h_l)`` the chance that the first ``i`` drafts
        are accepted and ``h_l = (rejected at l + hazard) / (reached l + 1)``: the counted
        rate at position ``l``, shrunk toward ``hazard`` (one trip's weight of it; it
        stands alone at positions no trip reached). With ``h_l = hazard`` everywhere this
        is eq. 1 of Leviathan et al. 2023 for ``a = 1 - hazard``; counted by position it
        also holds for bursty acceptance -- a file's line echoed is accepted whole or
        left at its first token -- which one rate per token underrates at long drafts."""
        survive, total = 1.0, 1.0
        for i in range(min(drafts, self.limit)):
            survive *= 1.0 - (self.rejected[i] + hazard) / (self.reached[i] + 1.0)
            total += survive
        return total


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
    _pause: int = 0  # steps left without a draft
    _pauses: int = 0
    _steps: int = 0
    _since_trip: int = 0  # steps since the last verifying trip
    #: accepted-run lengths per evidence (:attr:`Drafter.evidence`), and over all trips (key None)
    _runs: dict[tuple[str, int] | None, RunLengths] = field(default_factory=dict)

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
        expected tokens per trip over its cost, :meth:`expected` ``/ cost(j)``, for this
        request's drafts on the same ``evidence`` (a 5-token match is likelier right than
        a 2-token one; evidence never tried yet is tried at :attr:`k`) -- the walltime
        improvement of Leviathan et al. 2023 (arXiv:2211.17192) §3.5 -- when that beats
        a plain trip (> 1); else no draft, but a full-length probe once :data:`PROBE` steps went by
        without a verifying trip -- offered on every step until the drafter has a draft
        and one goes (a probe on a step where the drafter has nothing measures nothing)."""
        self._steps += 1
        self._since_trip += 1
        if self._pause > 0:
            self._pause -= 1
            return 0
        if cost is None or self.trips == 0 or (evidence and evidence[0] and evidence not in self._runs):
            return self.k
        best, value = 0, 1.0
        for j in range(1, self.k + 1):
            c = cost(j)
            if c is None:
                return self.k  # not measured at this length yet: draft to measure it
            gain = self.expected(evidence, j) / c
            if gain > value:
                best, value = j, gain
        if best:
            return best
        # not paying: a probe at full length, to measure what the drafter gives now (at the
        # short length the misses left, a probe could never show a trip paying)
        return self.limit if self._since_trip >= self.PROBE else 0

    @property
    def acceptance_estimate(self) -> float:
        """This request's per-token acceptance (:meth:`RunLengths.acceptance`) over all its
        trips, each trip's counts decayed by :data:`DECAY` per later trip; 0.5 before any trip."""
        runs = self._runs.get(None)
        return runs.acceptance() if runs is not None else 0.5

    #: how much a trip's acceptance counts one trip later
    DECAY = 0.7

    def acceptance_for(self, evidence: tuple[str, int] | None) -> float:
        """The per-token acceptance of this request's drafts on ``evidence`` (their source
        and match length, :attr:`Drafter.evidence`), counted and decayed as
        :attr:`acceptance_estimate` over those trips alone; that estimate while they
        weigh less than one verdict."""
        runs = self._runs.get(evidence) if evidence and evidence[0] else None
        return runs.acceptance() if runs is not None and runs.verdicts >= 1.0 else self.acceptance_estimate

    def expected(self, evidence: tuple[str, int] | None, drafts: int) -> float:
        """Tokens a trip of ``drafts`` drafts on ``evidence`` is expected to give
        (:meth:`RunLengths.expected`): from the run lengths of this request's trips on that
        evidence (over all its trips while those weigh less than one trip), shrunk toward
        the per-token rate ``1 -`` :meth:`acceptance_for` ``(evidence)``."""
        runs = self._runs.get(evidence) if evidence and evidence[0] else None
        if runs is None or runs.weight < 1.0:
            runs = self._runs.get(None) or RunLengths(self.limit)
        return runs.expected(drafts, 1.0 - self.acceptance_for(evidence))

    def verified(self, drafted: int, accepted: int, evidence: tuple[str, int] | None = None) -> None:
        """A step drafted ``drafted`` tokens on ``evidence`` and the model accepted
        ``accepted`` of them."""
        self.drafted += drafted
        self.accepted += accepted
        self.trips += 1
        self._since_trip = 0
        for key in (None, evidence) if evidence and evidence[0] else (None,):
            self._runs.setdefault(key, RunLengths(self.limit)).add(drafted, accepted, self.DECAY)
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
    return before_stop(proposal[:k] if k > 0 else [], stop_ids), k


def before_stop(drafts: Sequence[int], stop_ids: Container[int]) -> list[int]:
    """``drafts`` up to the first stop token (the model's own draw decides a stop)."""
    return list(drafts[:next((i for i, t in enumerate(drafts) if t in stop_ids), len(drafts))])


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
