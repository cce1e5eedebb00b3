"""Starting a tensor group's rank processes.

A :class:`RankLauncher` starts one :mod:`ringlet.daemon.tensor.worker` process per rank
and hands back a :class:`RankHandle` the supervisor waits on and kills;
:class:`LocalLauncher` starts them on this machine, each in its own session and process
group, so that SIGKILL to the process group takes the whole rank down.
:func:`free_port_block` finds the ports of a group's MLX host configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Protocol

from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.wire import ports


class RankHandle(Protocol):
    """A started rank process: its pid; wait for its exit code, or kill it."""

    pid: int

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class RankLauncher(Protocol):
    """Starts one rank process of member ``node_id`` (``argv``, ``env``, output to ``log_path``)."""

    async def start(self, node_id: str, argv: list[str], env: dict[str, str], log_path: Path) -> RankHandle: ...


class LocalRankHandle:
    """A rank process started on this machine (its own session and process group)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.pid = proc.pid

    async def wait(self) -> int:
        code = await self.proc.wait()
        if self.proc.stdin is not None:  # a rank that watches its stdin pipe (--exit-with-stdin)
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        return code

    def kill(self) -> None:
        """SIGKILL the rank's whole process group (it leads its own session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class LocalLauncher:
    """Starts every rank on this machine (ranks of one group simulated on loopback, or
    this node's own rank). Each rank gets its own session/process group."""

    async def start(self, node_id: str, argv: list[str], env: dict[str, str], log_path: Path) -> RankHandle:
        return await start_rank_process(argv, env, log_path)


async def start_rank_process(argv: list[str], env: dict[str, str], log_path: Path,
                             stdin_pipe: bool = False) -> LocalRankHandle:
    """Start one rank process here in its own session, output appended to ``log_path``;
    stdin is a pipe this process holds when ``stdin_pipe``, else /dev/null."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    return LocalRankHandle(proc)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base+n-1`` can all be bound on ``host`` right now,
    outside the kernel's ephemeral range (:func:`ringlet.daemon.wire.ports.free_port_block`).

    Raises:
        TPGroupError: no such block was found.
    """
    try:
        return ports.free_port_block(n, host)
    except OSError as exc:
        raise TPGroupError(str(exc)) from exc
