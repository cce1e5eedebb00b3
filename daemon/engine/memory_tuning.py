"""Allocator settings for a process that moves large tensors.

glibc raises its mmap threshold dynamically (up to 32 MiB on 64-bit) each time a
large block is freed, after which tensor-sized temporaries come from the heap and
are kept there instead of being returned to the OS. Fixing the threshold at
128 KiB (``mallopt(M_MMAP_THRESHOLD)``; glibc ``malloc/malloc.c``, "mmap_threshold")
keeps every large temporary an ``mmap`` that is unmapped when freed, so a stage's
resident memory tracks the weights it holds. No-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3


def tune_allocator(mmap_threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap and trim thresholds (bytes). Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1 and ok
    except (OSError, AttributeError):
        return False
    log.debug("glibc mmap threshold fixed at %d bytes: %s", mmap_threshold, ok)
    return ok
