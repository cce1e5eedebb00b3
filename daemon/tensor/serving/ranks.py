"""Rank processes of tensor groups on this machine: the worker's command line
(:func:`worker_argv`), its environment (:func:`rank_base_env`), starting it
(:func:`spawn_rank`), and what a leader may set for a rank it asks a member to run
(``RunRank``: MLX's own variables and host files only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ringlet.daemon.tensor.control import TOKEN_ENV
from ringlet.daemon.tensor.launch import LocalRankHandle, start_rank_process
from ringlet.daemon.tensor.planning.mlx_hosts import HOSTFILE_NAME, IBV_DEVICES_NAME

#: Environment variable of the daemon: a library preloaded into its rank processes only
#: (tests use MLX's poll shim, tests/tp_support.py, to run more ranks than cores).
PRELOAD_ENV = "RINGLET_TP_LD_PRELOAD"
#: Variables and host files a leader may set for a rank (MLX's own configuration only).
RANK_ENV_KEYS = frozenset({"MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR"})
RANK_FILES = frozenset({HOSTFILE_NAME, IBV_DEVICES_NAME})
RANK_DTYPES = frozenset({"float32", "bfloat16", "float16", "model"})


async def spawn_rank(argv: list[str], env: dict[str, str], log_path: Path) -> LocalRankHandle:
    """Start a rank process: own session, output to ``log_path``, stdin a pipe this
    process holds (``--exit-with-stdin``: the rank leaves when this daemon dies)."""
    if "--exit-with-stdin" not in argv:
        argv = [*argv, "--exit-with-stdin"]
    return await start_rank_process(argv, env, log_path, stdin_pipe=True)


def rank_base_env() -> dict[str, str]:
    """This daemon's environment without MLX's variables, plus the rank preload if set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_") and k != TOKEN_ENV}
    preload = os.environ.get(PRELOAD_ENV)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def worker_argv(
    model: str, *, control: str, rank: int, size: int, epoch: int, dtype: str, backend: str,
    hb_interval: float, prefill_chunk: int, side_host: str, layers: tuple[int, int] | None = None,
) -> list[str]:
    """``python -m ringlet.daemon.tensor.worker ...`` for this machine's Python and model
    (``layers``: a hybrid group's half-open layer range; ``None`` = every layer)."""
    argv = [
        sys.executable, "-m", "ringlet.daemon.tensor.worker", "--control", control, "--rank", str(rank),
        "--size", str(size), "--epoch", str(epoch), "--dtype", dtype, "--backend", backend,
        "--hb-interval", str(hb_interval), "--prefill-chunk", str(prefill_chunk), "--side-host", side_host,
        "--model", model, "--exit-with-stdin",
    ]
    if layers is not None:
        argv += ["--layers", f"{layers[0]}:{layers[1]}"]
    return argv
