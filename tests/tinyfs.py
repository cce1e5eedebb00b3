"""A tiny real filesystem for the full-disk tests: a size-limited tmpfs mounted on a
directory of the test's, and a filler file that takes its free space.

Mounting needs root (CAP_SYS_ADMIN): without it the tests that use it are skipped,
saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = ".filler"


@contextlib.contextmanager
def tiny_fs(where: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted on ``where`` (made if missing);
    unmounted on exit, whatever happened inside."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, leave: int = 0) -> int:
    """Take all but ``leave`` bytes of the free space of the filesystem at ``fs`` with a
    filler file (``fs / FILLER``, grown if it exists). Returns the bytes free after."""
    free = shutil.disk_usage(fs).free
    filler = fs / FILLER
    with open(filler, "ab") as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), filler.stat().st_size, max(0, free - leave))
    return shutil.disk_usage(fs).free


def unfill(fs: Path) -> None:
    """Give the filler's space back."""
    (fs / FILLER).unlink(missing_ok=True)
