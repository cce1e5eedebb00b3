"""Error types every layer shares: the lowest layer of ``daemon/`` (it imports nothing of ringlet).

:class:`RingletError` and its subclasses are user-facing: each carries a message that
names the problem and the fix; the CLI prints it on one line and exits non-zero, never
with a traceback. :class:`GenerationError` is what a generation ends with when a stage
fails it; the API turns it into an HTTP error with that message. :class:`DiskFull` is a write
refused for want of space (:func:`disk_full` makes one from the ``OSError``)."""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path


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


#: ``errno`` values that mean "no room left": the filesystem is full (ENOSPC) or the
#: user's quota is spent (EDQUOT).
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFull(RingletError, OSError):
    """A write stopped because the filesystem (or the quota) is full.

    Also an :class:`OSError` (``errno`` ENOSPC or EDQUOT), so code that handles a failed
    write keeps handling it. Attributes: ``path`` (the file being written), ``needed`` and
    ``free`` (bytes; ``free`` is what the filesystem had left when the write failed,
    ``-1`` when it cannot be read), ``what`` (what was being written, for the message).
    """

    def __init__(self, path, needed: int, free: int, what: str = "", code: int = errno.ENOSPC):
        self.needed, self.free, self.what = int(needed), int(free), what
        doing = f" ({what})" if what else ""
        have = f"{human_bytes(self.free)} free" if self.free >= 0 else "free space unknown"
        message = (f"disk full: cannot write {path}{doing}: needs {human_bytes(self.needed)}, {have} there; "
                   "free some space or point it at a larger disk")
        OSError.__init__(self, code, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return DiskFull, (self.filename, self.needed, self.free, self.what, self.errno)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused for want of space (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS


def disk_full(exc: BaseException, path, needed: int, what: str = "") -> DiskFull | None:
    """``exc`` as a :class:`DiskFull` naming ``path``, the ``needed`` bytes and the space
    free on ``path``'s filesystem (read now), when it is a "no space" error (ENOSPC,
    EDQUOT); ``None`` for any other error (the caller re-raises or handles it).
    A :class:`DiskFull` is returned as it is."""
    if isinstance(exc, DiskFull) or not is_disk_full(exc):
        return exc if isinstance(exc, DiskFull) else None
    return DiskFull(path, needed, free_bytes(path), what, exc.errno)


def free_bytes(path) -> int:
    """Bytes free to this process on the filesystem holding ``path`` (its nearest
    existing ancestor), or ``-1`` when it cannot be read."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return -1


def human_bytes(n: int) -> str:
    """``n`` bytes in decimal units: ``"512 bytes"``, ``"1.5 kB"``, ``"3.2 MB"``, ``"1.25 GB"``."""
    if n < 1000:
        return f"{n} bytes"
    for unit, scale, digits in (("kB", 1e3, 1), ("MB", 1e6, 1), ("GB", 1e9, 2)):
        if n < scale * 1000 or unit == "GB":
            return f"{n / scale:.{digits}f} {unit}"
    raise AssertionError("unreachable")
