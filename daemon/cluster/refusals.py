"""Refused proposals without a storm: reconciling two views of the membership, backing off,
and logging each cause once with a count.

A proposal refused because the membership differs (or because the refuser has not
admitted the proposer yet: :func:`views_differ`) means two members see different
clusters. Proposing again at once cannot succeed until the views agree, and it used to
be repeated twice a second (143 refusals a minute in issue 36's soak). Instead:

* the refuser dials the members the proposal lists that it lacks, and its refusal lists
  its own members (``Vote.members``), which the proposer dials
  (:meth:`~ringlet.daemon.cluster.membership.Membership.learn`): the views converge
  through the same handshakes as an mDNS advert;
* the proposer waits :class:`Backoff` before the next round (:data:`RECONCILE_MIN_S`,
  doubling to :data:`RECONCILE_MAX_S`), and proposes sooner when every member's beats
  report its own view (``Heartbeat.membership_digest``: the views agree now), or when
  its own membership changed (not within :data:`RECONCILE_MIN_S`): :func:`wait_to_propose`;
* each side logs a cause once, then how many more times it happened, at most every
  :data:`LOG_EVERY_S` seconds (:class:`CountedLog`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable

from ringlet.daemon.errors import RingletError

__all__ = ["LOG_EVERY_S", "MEMBERSHIP_DIFFERS", "NON_MEMBER", "RECONCILE_MAX_S", "RECONCILE_MIN_S", "Backoff",
           "CountedLog", "load_failure_level", "views_differ", "wait_to_propose"]

#: The refusal reason for a proposal made from another view of the membership.
MEMBERSHIP_DIFFERS = "membership differs from this node's view"
#: How the refusal of a proposal whose proposer this node has not admitted begins.
NON_MEMBER = "proposal from a non-member"


def load_failure_level(exc: BaseException) -> int:
    """The log level of the traceback of a stage that failed to load: ``DEBUG`` for a
    :class:`~ringlet.daemon.errors.RingletError` (a full disk, a short one, a missing file:
    its message says it all, and the refusal logs it once with a count, while a proposer
    retries several times a second), ``ERROR`` for anything else (a bug)."""
    return logging.DEBUG if isinstance(exc, RingletError) else logging.ERROR


def views_differ(reason: str) -> bool:
    """Whether a refusal's ``reason`` says the two nodes see different memberships (the
    digest differs, or the refuser has not admitted the proposer yet): both reconcile."""
    return reason == MEMBERSHIP_DIFFERS or reason.startswith(NON_MEMBER)
#: The least wait before a proposal follows one refused for a membership difference, s.
RECONCILE_MIN_S = 1.0
#: The longest such wait, seconds (views that disagree this long have a member that one
#: side cannot reach: its heartbeats remove it within seconds, then they agree).
RECONCILE_MAX_S = 8.0
#: A cause already logged is logged again (with the count since) at most this often, s.
LOG_EVERY_S = 30.0
#: Causes remembered by a :class:`CountedLog` (the oldest is forgotten beyond).
MAX_CAUSES = 256
#: How often :func:`wait_to_propose` looks whether the views agree, seconds.
POLL_S = 0.05


async def wait_to_propose(wait_s: float, floor_s: float, changed: asyncio.Event,
                          agreed: Callable[[], bool]) -> None:
    """The wait after a refused round: ``floor_s`` seconds at least, then until ``wait_s``
    seconds have passed, or ``agreed()`` (every member reports this node's view), or
    ``changed`` is set (this node's membership changed) and :data:`RECONCILE_MIN_S` passed."""
    t0 = time.monotonic()
    await asyncio.sleep(min(wait_s, floor_s))
    while (elapsed := time.monotonic() - t0) < wait_s:
        if agreed() or (changed.is_set() and elapsed >= RECONCILE_MIN_S):
            return
        await asyncio.sleep(POLL_S)


class Backoff:
    """Waits that double from ``first_s`` to ``max_s`` (each jittered by +-20 %) until
    :meth:`reset`."""

    def __init__(self, first_s: float = RECONCILE_MIN_S, max_s: float = RECONCILE_MAX_S):
        self.first_s = first_s
        self.max_s = max_s
        self.rounds = 0

    def next(self) -> float:
        """The next wait, seconds (never below ``first_s``)."""
        wait = min(self.max_s, self.first_s * 2**self.rounds)
        self.rounds += 1
        return max(self.first_s, wait * random.uniform(0.8, 1.2))  # noqa: S311 - jitter, not crypto

    def reset(self) -> None:
        self.rounds = 0


class CountedLog:
    """Log a line the first time its cause occurs, then, at most every ``every_s`` seconds,
    again with how many times it occurred in between.

    Args:
        logger: where the lines go.
        every_s: seconds between two lines of one cause.
    """

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S):
        self.logger = logger
        self.every_s = every_s
        self._causes: dict[str, list[float]] = {}  # cause -> [count not logged, monotonic time last logged]
        #: occurrences of each kind of cause since the start (see :meth:`__call__`)
        self.totals: Counter[str] = Counter()

    def __call__(self, level: int, cause: str, kind: str | None = None) -> None:
        """One occurrence of ``cause`` (the whole line, without the count), counted in
        :attr:`totals` under ``kind`` (default: ``cause``)."""
        now = time.monotonic()
        self.totals[kind or cause] += 1
        if len(self.totals) > MAX_CAUSES:
            self.totals.pop(next(iter(self.totals)))
        entry = self._causes.get(cause)
        if entry is not None and now - entry[1] < self.every_s:
            entry[0] += 1
            return
        more = f" ({int(entry[0])} more in the last {now - entry[1]:.0f} s)" if entry is not None and entry[0] else ""
        self.logger.log(level, "%s%s", cause, more)
        self._causes.pop(cause, None)
        self._causes[cause] = [0, now]
        while len(self._causes) > MAX_CAUSES:
            self._causes.pop(next(iter(self._causes)))

    def pending(self, cause: str) -> int:
        """Occurrences of ``cause`` not logged yet."""
        entry = self._causes.get(cause)
        return int(entry[0]) if entry is not None else 0
