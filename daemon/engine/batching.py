"""Which decode steps a stage runs as one batched forward.

A batch on a pipeline ring is only worth its padding if it is the *same* batch at every
stage and from one step to the next: then its members' KV caches stay merged
(:mod:`.decode_groups`) and no stage copies them. And on a ring of S stages the batches
must be S at least, or all but one stage idle while the one batch passes through
another. So:

* a step that names the batch the previous stage computed it in (``siblings``, from
  ``Activation.batch_ids``) runs with those of them waiting here, after waiting up to
  ``wait_s`` for the rest: every stage runs the batches stage 0 formed;
* otherwise (stage 0) a step of a request in a decode group runs with its group,
  waiting the same way for members still to come;
* and at stage 0 the whole groups whose steps are all waiting, then one-token steps of
  requests in no group, join the batch (a group, or a new one), up to ``cap``:
  ``ceil(requests here / stages)`` (the scheduler's ``ring_depth``), so 4 requests on 2
  stages make 2 groups of 2, and both stages always have one to run. Groups that formed
  while fewer requests had arrived (below the cap) merge into one that is not.

Measured (``bench_concurrency``, 2 stages, this machine): 4 concurrent requests gave
1.34x the 1-request tokens/s when every waiting step joined one batch, merged and split
per step, and 2.27x with these rules and kept groups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


@dataclass
class Work:
    """One queued step (or release) of one request."""

    request_id: str
    future: asyncio.Future
    step: int = 0
    offset: int = 0
    payload: list[int] | pb.Tensor | None = None
    sampling: SamplingParams | None = None
    more: bool = False
    release: bool = False
    prefix_ids: list[int] | None = None  # first chunk of a request reusing a cached prefix
    scope: str = ""  # its prefix cache scope (first chunk), or the ids to store (release)
    token_ids: list[int] | None = None
    ids: list[int] | None = None  # the token ids a hidden-states payload stands for
    siblings: tuple[str, ...] | None = None  # the batch the previous stage computed it in
    queued_at: float = 0.0  # time.monotonic() when it was queued, seconds
    drafts: int = 0  # a verifying step: its last ``drafts`` tokens are drafted (:mod:`.speculation`)

    @property
    def decode(self) -> bool:
        """A one-token step that can join a batch."""
        return not self.release and not self.more and self.tokens == 1

    @property
    def tokens(self) -> int:
        """Tokens the step computes (0 for a release)."""
        if isinstance(self.payload, list):
            return len(self.payload)
        if isinstance(self.payload, pb.Tensor) and len(self.payload.shape) >= 2:
            return int(self.payload.shape[1])
        return 0


def choose_batch(queue: Iterable[Work], group_of: Callable[[str], tuple | None], requests: Container[str],
                 max_batch: int, cap: int, wait_s: float, now: float) -> tuple[list[Work], float]:
    """The steps of the next forward, by the rules above.

    Args:
        queue: the waiting steps, oldest first (no releases), not empty.
        group_of: a request's decode group members here (``None``: in no group).
        requests: the requests with a KV cache here (a member not among them is gone:
            nobody waits for it).
        max_batch: the most steps in one forward.
        cap: the most steps in a batch that stage 0 forms (from groups and ungrouped requests).
        wait_s: the longest the oldest step waits for the rest of its batch, seconds,
            counted from when it was queued.
        now: ``time.monotonic()``.

    Returns:
        The chosen steps (the oldest first; empty while waiting) and, when empty, the
        seconds left to wait before choosing again.
    """
    steps = list(queue)
    first = steps[0]
    if not first.decode or max_batch == 1:
        return [first], 0.0
    chosen: dict[str, Work] = {}
    members = first.siblings or group_of(first.request_id)
    if members is not None:  # its batch: the previous stage's, or its group here
        wanted = set(members) | {first.request_id}
        for work in steps:
            if len(chosen) < max_batch and work.decode and work.request_id in wanted and work.request_id not in chosen:
                chosen[work.request_id] = work
        queued = {w.request_id for w in steps if w.decode}
        wait = first.queued_at + wait_s - now
        if wait > 0 and any(m not in queued and m in requests for m in wanted):
            return [], wait
    if first.siblings is None:  # stage 0: other whole groups, then requests in no group, join up to the cap
        decode = {w.request_id: w for w in steps if w.decode and not w.siblings}
        for work in steps:
            other = group_of(work.request_id) if work.request_id in decode else None
            if (other is not None and work.request_id not in chosen and len(chosen) + len(other) <= cap
                    and all(m in decode for m in other)):
                chosen.update((m, decode[m]) for m in other)
        for work in steps:
            if len(chosen) >= cap:
                break
            if (work.decode and work.request_id not in chosen and not work.siblings
                    and group_of(work.request_id) is None):
                chosen[work.request_id] = work
    return [w for w in steps if chosen.get(w.request_id) is w], 0.0


def batch_figures(max_batch: int, last: int, recent: Iterable[tuple[float, int]], histogram: Mapping[int, int],
                  queued: int, window_s: float, now: float, unmerged: int = 0) -> dict:
    """Decode batching figures for ``/v1/cluster``: the limit, the last batch, the mean
    batch over the last ``window_s`` seconds (from ``recent`` (monotonic time, size)
    pairs), the histogram since start (size -> forwards), the steps waiting and
    ``unmerged`` (the decode groups' count of batches whose caches could not merge)."""
    sizes = [n for t, n in recent if now - t <= window_s]
    return {
        "max_batch": max_batch,
        "last_batch": last,
        "mean_batch_recent": sum(sizes) / len(sizes) if sizes else None,
        "histogram": {str(k): v for k, v in sorted(histogram.items())},
        "queued": queued,
        "unmerged": unmerged,
    }
