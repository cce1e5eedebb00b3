"""Whether the daemon draws in its terminal."""

from __future__ import annotations

import os
import sys

__all__ = ["foreground_terminal"]


def foreground_terminal() -> bool:
    """Whether stdout is a terminal this process has in the foreground: a daemon started
    with ``&`` in a shell shares the terminal with the commands typed after it, and a bar or
    dashboard redrawn there erases their output; it logs plainly instead."""
    if not sys.stdout.isatty():
        return False
    try:
        return os.tcgetpgrp(sys.stdout.fileno()) == os.getpgrp()
    except OSError:
        return False
