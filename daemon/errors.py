"""Error types every layer shares: the lowest layer of ``daemon/`` (it imports nothing of ringlet).

:class:`RingletError` and its subclasses are user-facing: each carries a message that
names the problem and the fix; the CLI prints it on one line and exits non-zero, never
with a traceback. :class:`GenerationError` is what a generation ends with when a stage
fails it; the API turns it into an HTTP error with that message."""

from __future__ import annotations

import contextlib


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


def one_line(exc: BaseException) -> str:
    """``exc`` as one line of plain words for events and error messages: a gRPC error
    (anything with ``code()`` and ``details()``) as ``CODE: first line of the detail``,
    any other as the first line of its message (its type's name when it has none);
    never an object's multi-line repr."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        with contextlib.suppress(Exception):  # a half-built error object: use its message
            name = getattr(code(), "name", str(code()))
            detail = first_line(str(details() or ""))
            return f"{name}: {detail}" if detail else name
    return first_line(str(exc)) or type(exc).__name__


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped (``""`` if none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
