"""The leader's tensor group across the members' daemons.

:class:`ClusterLauncher` starts the leader's own rank here and every other rank through
that member's daemon (``RunRank``), each then held by a remote rank handle for as long as
its call lasts; :class:`DaemonGroup` restarts the group only on the committed plan's
members, and only while they all answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from ringlet.daemon.tensor.control import TOKEN_ENV
from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.tensor.launch import LocalRankHandle
from ringlet.daemon.tensor.planning.decision import TPDecision
from ringlet.daemon.tensor.serving.ranks import RANK_ENV_KEYS, spawn_rank
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

if TYPE_CHECKING:
    from ringlet.daemon.tensor.serving.core import TPServing

log = logging.getLogger(__name__)

#: Seconds the leader waits for a member to start its rank process.
RANK_START_TIMEOUT_S = 60.0


def _argv_options(argv: Sequence[str]) -> dict[str, str]:
    """``--name value`` pairs of a tp_worker command line (flags without a value map to "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a[2:]] = argv[i + 1]
                i += 2
                continue
            out[a[2:]] = ""
        i += 1
    return out


class _RemoteHandle:
    """A rank run by another member's daemon, for as long as its RunRank call lasts."""

    def __init__(self, call, pid: int):
        self.call = call
        self.pid = pid
        self._code: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        code = -int(signal.SIGKILL)
        try:
            while True:  # read(), not async-for: the first event was read() already, and gRPC forbids mixing
                event = await self.call.read()
                if event is grpc.aio.EOF:
                    break
                if event.WhichOneof("event") == "exit_code":
                    code = event.exit_code
                    break
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the member is gone or the call was cancelled: the rank is dead or being killed
        except Exception:  # noqa: BLE001 - whatever went wrong, wait() must return
            log.exception("rank call to a member failed")
        finally:
            if not self._code.done():
                self._code.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._code)

    def kill(self) -> None:
        """Cancel the call: the member kills the rank's process group."""
        self.call.cancel()


class ClusterLauncher:
    """Starts this node's rank here and every other rank on its member's machine (RunRank)."""

    def __init__(self, serving: TPServing, plan_epoch: int):
        self.serving = serving
        self.plan_epoch = plan_epoch

    async def start(self, node_id: str, argv: list[str], env: dict[str, str],
                    log_path: Path) -> LocalRankHandle | _RemoteHandle:
        """Start one rank; raises :class:`TPGroupError` when its member refuses or is unreachable."""
        if node_id == self.serving.node.node_id:
            return await spawn_rank(argv, env, log_path)
        opts = _argv_options(argv)
        directory = str(log_path.parent)
        files, rank_env = {}, {}
        for key, value in env.items():
            if key not in RANK_ENV_KEYS:
                continue
            if value.startswith(directory + os.sep):
                name = Path(value).name
                files[name] = Path(value).read_text()
                value = "{dir}/" + name
            rank_env[key] = value
        request = pb.RankStart(
            leader_id=self.serving.node.node_id, plan_epoch=self.plan_epoch, group_epoch=int(opts["epoch"]),
            rank=int(opts["rank"]), size=int(opts["size"]), backend=opts["backend"], control=opts["control"],
            token=env.get(TOKEN_ENV, ""), dtype=opts["dtype"], hb_interval=float(opts["hb-interval"]),
            prefill_chunk=int(opts["prefill-chunk"]), side_host=opts["side-host"], files=files, env=rank_env,
        )
        if opts.get("layers"):
            request.layer_start, request.layer_end = (int(x) for x in opts["layers"].split(":"))
        address = self.serving.address_of(node_id)
        if not address:
            raise TPGroupError(f"rank {request.rank}: {node_id} is not a member")
        call = self.serving.stub(address).RunRank(request)
        try:
            first = await asyncio.wait_for(call.read(), RANK_START_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            call.cancel()
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
            raise TPGroupError(f"rank {request.rank} on {node_id} did not start: {detail}") from None
        if first is grpc.aio.EOF or first.WhichOneof("event") != "pid":
            call.cancel()
            why = first.error if first is not grpc.aio.EOF and first.WhichOneof("event") == "error" else "no answer"
            raise TPGroupError(f"rank {request.rank} on {node_id} did not start: {why}")
        return _RemoteHandle(call, first.pid)


class DaemonGroup(TPGroup):
    """A TPGroup that keeps the committed plan's ranks: after a failure it restarts on the
    same members (a rank process that crashed on a live member; in-flight requests resume
    inside the group), but only when every member still answers, and at most
    ``max_restarts`` times in a row. Otherwise it fails, and the cluster's re-plan decides
    what serves next (requests resume on that plan)."""

    def __init__(self, *args: Any, reachable: Callable[[str], Awaitable[bool]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._reachable = reachable

    def _replan(self, lost: set[str], why: str, same_members: bool) -> TPDecision:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return TPDecision("pipeline", "none", (self.leader,),
                              f"{why}; {self.restarts - 1} restarts failed")
        return self._initial

    async def _start_epoch(self, decision: TPDecision):  # -> tp_group._Epoch
        if self._epoch is not None:  # a restart: do not start ranks while a member is gone
            gone = [n for n in decision.ranks if n != self.leader and not await self._reachable(n)]
            if gone:
                raise TPGroupError(f"{self._last_why}; member(s) {', '.join(gone)} do not answer: waiting for "
                                   "the cluster to re-plan")
        return await super()._start_epoch(decision)
