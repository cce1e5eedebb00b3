"""Why a request cannot proceed on a stage: the errors a :class:`~.scheduler.StageEngine`
step or release fails with (each fails that request only)."""

from __future__ import annotations

__all__ = ["PrefixMiss", "RequestDropped", "RequestError", "RequestRetry"]


class RequestError(Exception):
    """A request cannot proceed on this stage (unknown request, offset mismatch, ...)."""


class RequestDropped(RequestError):
    """The request's work was dropped before it ran: released, or the plan changed."""


class PrefixMiss(RequestError):
    """This stage's prefix store cannot serve the prefix stage 0 chose for a request;
    ``holds`` is how many of its tokens it can serve (stage 0 retries with at most that)."""

    def __init__(self, message: str, holds: int):
        super().__init__(message)
        self.holds = holds


class RequestRetry(RequestError):
    """The request's KV cache on this stage is gone but the plan still stands (a tensor
    group restarted): stage 0 may resume the request on the same plan by prefilling it
    again (``Activation.retry``)."""
