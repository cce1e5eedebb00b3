"""Why one try of a generation ended without a result: the resume loop's signals.

Each is a :class:`~ringlet.daemon.errors.GenerationError`; the API node's resume loop
(:mod:`ringlet.daemon.node.resume`) tells them apart to decide how to go on."""

from __future__ import annotations

from ringlet.daemon.errors import GenerationError


class PlanChanged(GenerationError):
    """The committed plan changed under a request (it resumes on the new one).

    ``epoch`` is the newly committed epoch where known (0 = unknown): stage 0 sends it
    with the error (``GenerateEvent.plan_epoch``) so an API node that has not committed
    that epoch yet waits for it instead of taking the error for a failed stage."""

    def __init__(self, message: str, epoch: int = 0):
        super().__init__(message)
        self.epoch = epoch


class EpochSkew(GenerationError):
    """Stage 0, or a later stage, has not committed the caller's epoch yet (or has a newer one): members
    commit a plan within moments of each other, so the request is simply retried."""


class RetryOnPlan(GenerationError):
    """A stage lost the request's KV cache while the plan stands (its tensor group
    restarted): the request resumes on the same plan (``Activation.retry``)."""


class PrefixMissed(GenerationError):
    """A later stage's prefix store lacks the prefix stage 0 chose; it holds ``holds`` of
    its tokens (stage 0 starts the request again with at most that many)."""

    def __init__(self, message: str, holds: int):
        super().__init__(message)
        self.holds = holds
