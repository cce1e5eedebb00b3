"""A daemon started with ``&`` shares its terminal with the commands typed after it: it must
not draw its loading bar or dashboard there (they erased ``ringlet chat``'s answer), while
one run in the foreground of its terminal still does. Checked on a real pseudo-terminal:
a session whose controlling terminal it is, a process in its foreground process group, and
one in a process group of its own (what a shell's ``&`` makes)."""

from __future__ import annotations

import os
import subprocess
import sys

SESSION = r'''
import fcntl, subprocess, sys, termios
fd = int(sys.argv[1])
fcntl.ioctl(fd, termios.TIOCSCTTY, 0)  # the pty becomes this new session's controlling terminal
probe = ("import sys; from ringlet.daemon.ops.terminal import foreground_terminal as f; "
         "print(f(), file=sys.stderr)")
fg = subprocess.run([sys.executable, "-c", probe], stdout=fd, stderr=subprocess.PIPE, text=True)
bg = subprocess.run([sys.executable, "-c", probe], stdout=fd, stderr=subprocess.PIPE, text=True, process_group=0)
print(fg.stderr.strip(), bg.stderr.strip())
'''


def test_only_the_foreground_process_group_draws_on_the_terminal():
    master, slave = os.openpty()
    try:
        out = subprocess.run([sys.executable, "-c", SESSION, str(slave)], pass_fds=(slave,), start_new_session=True,
                             capture_output=True, text=True, timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
    piped = subprocess.run([sys.executable, "-c", "from ringlet.daemon.ops.terminal import foreground_terminal as f; "
                            "print(f())"], capture_output=True, text=True, timeout=120)
    assert piped.stdout.strip() == "False"  # not a terminal at all
