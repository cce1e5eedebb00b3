"""One rank of a tensor-parallel group: ``python -m ringlet.daemon.tensor.worker ...``.

Started by :mod:`ringlet.daemon.tensor.group` with MLX's environment already set
(``MLX_RANK`` + ``MLX_HOSTFILE`` for ring; ``MLX_IBV_DEVICES`` +
``MLX_JACCL_COORDINATOR`` for jaccl; see :mod:`ringlet.daemon.tensor.planning`).
This module is the entry point: it runs a rank's life, the parts live in

* :mod:`ringlet.daemon.tensor.control` -- the control socket to the supervisor, heartbeats;
* :mod:`ringlet.daemon.tensor.side_channel` -- rank 0's step headers to the other ranks;
* :mod:`ringlet.daemon.tensor.rank` -- the model and its forward work, ranks > 0 following;
* :mod:`ringlet.daemon.tensor.rank_lead` -- rank 0 serving requests and driving the others.

Life of a rank
--------------
1. connect to the supervisor's control socket, send ``hello`` (rank, pid);
2. load the *whole* model with ringlet's loader (``load_stage(loc, 0, None)``),
   send ``loaded``;
3. on ``init`` (sent once every rank has loaded, so no rank gives up waiting for a
   slow neighbour), ``mx.distributed.init(backend, strict=True)``,
   ``model.shard(group)``, check the group with one all_sum, send ``ready``;
4. serve. Rank 0 takes requests (``gen``, ``logits``, ``bench``, ``cancel``) from
   the supervisor and drives every rank in lockstep: before each model step it
   sends every other rank a small binary header over a direct TCP *side channel*
   (rank 0 listens, the others connect at ``init``) saying what to run. All ranks then
   run the same collectives in the same order. When rank 0 goes away the side channel
   closes and the other ranks leave.

Stage mode (``--layers START:END``, hybrid plans): the rank loads only the layer range
``[START, END)`` and ``model.shard(group)`` splits it, so a group is one *stage* of a
pipeline; rank 0 then serves ``stage`` requests (:mod:`ringlet.daemon.tensor.rank_lead`).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback

from ringlet.daemon.paths import machine_cache_dir
from ringlet.daemon.probes import blas, colocated
from ringlet.daemon.tensor.control import TOKEN_ENV, Control, Health, heartbeat
from ringlet.daemon.tensor.rank import Rank
from ringlet.daemon.tensor.rank_lead import LeadRank


def _exit_on_stdin_eof() -> None:
    """Block reading stdin; at end of file (the launcher died, even by SIGKILL) leave at once."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ringlet tensor-parallel rank (started by the supervisor)")
    p.add_argument("--control", required=True, help="supervisor control address host:port")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="ring", choices=["ring", "jaccl", "none"])
    p.add_argument("--hb-interval", type=float, default=0.2)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--side-host", default="127.0.0.1", help="rank 0: address to listen on for the other ranks")
    p.add_argument("--layers", default="", help="stage mode: hold only the layer range START:END (hybrid plans)")
    p.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="exit when stdin closes (the launching daemon holds its other end: a rank never outlives it)",
    )
    args = p.parse_args(argv)
    # Before MLX is imported (lazily, by the rank): its CPU matmuls bind to this BLAS.
    blas.load()
    fixed = int(os.environ[blas.THREADS_ENV]) if os.environ.get(blas.THREADS_ENV, "").isdigit() else None
    colocated.ThreadSizer(machine_cache_dir() / colocated.DIR_NAME, fixed, kind="rank").start()
    if args.exit_with_stdin:
        threading.Thread(target=_exit_on_stdin_eof, name="tp-parent-watch", daemon=True).start()

    ctrl = Control(args.control)
    health = Health(phase="loading")
    token = os.environ.pop(TOKEN_ENV, "")  # not on the command line: ps shows argv to every user
    ctrl.send({"t": "hello", "token": token, "rank": args.rank, "pid": os.getpid(), "epoch": args.epoch})
    threading.Thread(target=heartbeat, args=(ctrl, health, args.rank, args.hb_interval), daemon=True).start()
    rank = (LeadRank if args.rank == 0 else Rank)(args, ctrl, health)
    try:
        rank.load()
        side_port = rank.open_side(args.side_host)
        ctrl.send({"t": "loaded", "rank": args.rank, "side_port": side_port})
        while True:
            msg = ctrl.inbox.get()
            if msg.get("t") == "shutdown":
                return 0
            if msg.get("t") == "init":
                break
        health.phase = "init"
        health.begin()
        rank.init_group(msg.get("side"))
        health.end()
        health.phase = "idle"
        ctrl.send(
            {
                "t": "ready",
                "rank": args.rank,
                "size": args.size,
                "backend": args.backend,
                "headless": rank.inner is not None,
                "trims": rank.trims(),
            }
        )
        if args.rank == 0:
            rank.lead_stage() if rank.stage_mode else rank.lead()
        elif not rank.follow():
            # rank 0 vanished: say so, so that this rank is not taken for the lost one
            ctrl.send({"t": "fatal", "rank": args.rank, "phase": "idle", "msg": "rank 0 closed the side channel"})
            return 1
        return 0
    except Exception as exc:  # one line to the supervisor, the traceback to our log
        traceback.print_exc()
        ctrl.send({"t": "fatal", "rank": args.rank, "phase": health.phase, "msg": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: MLX's ring destructors can block on sockets of a dead peer.
    os._exit(code)
