"""Error types every layer shares: the lowest layer of ``daemon/`` (it imports nothing).

:class:`RingletError` and its subclasses are user-facing: each carries a message that
names the problem and the fix; the CLI prints it on one line and exits non-zero, never
with a traceback. :class:`GenerationError` is what a generation ends with when a stage
fails it; the API turns it into an HTTP error with that message."""

from __future__ import annotations


class RingletError(Exception):
    """Base class for errors shown to users as ``error: <message>``."""


class ModelNotFound(RingletError):
    """The model path or short name does not resolve to model files."""


class ModelFormatError(RingletError):
    """The model files exist but are unreadable: truncated, corrupt, unsupported."""


class PlanError(RingletError, ValueError):
    """Layer ranges are invalid: overlapping, leaving gaps, or out of bounds."""


class GenerationError(Exception):
    """A generation failed on some stage; the message says where and why."""


class NoPlanError(GenerationError):
    """The cluster has no plan that serves the model (yet, or at all); the message says why."""
