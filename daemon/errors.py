"""User-facing errors. Each carries a message that names the problem and the fix;
the CLI prints it on one line and exits non-zero, never with a traceback."""

from __future__ import annotations


class RingletError(Exception):
    """Base class for errors shown to users as ``error: <message>``."""


class ModelNotFound(RingletError):
    """The model path or short name does not resolve to model files."""


class ModelFormatError(RingletError):
    """The model files exist but are unreadable: truncated, corrupt, unsupported."""


class PlanError(RingletError, ValueError):
    """Layer ranges are invalid: overlapping, leaving gaps, or out of bounds."""
