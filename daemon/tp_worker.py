"""One rank of a tensor-parallel group: ``python -m ringlet.daemon.tp_worker ...``.

Started by :mod:`ringlet.daemon.tp_group` with MLX's environment already set
(``MLX_RANK`` + ``MLX_HOSTFILE`` for ring; ``MLX_IBV_DEVICES`` +
``MLX_JACCL_COORDINATOR`` for jaccl; see :mod:`ringlet.daemon.tp_config`).

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
   broadcasts a small int32 header (an ``all_sum`` where the other ranks add
   zeros) saying what to run -- feed these token ids to this request's KV cache,
   free a cache, go idle, stop. So all ranks run the same collectives in the same
   order and no second channel is needed between ranks. Rank 0 samples
   (:class:`ringlet.daemon.sampling.RequestSampler`) and sends each token to the
   supervisor as soon as it exists. Requests interleave one step at a time;
   long prompts are prefilled in chunks.

Idle ranks must not wait inside a collective: MLX's ring backend polls its
sockets in a busy loop (one core at 100% per waiting rank), so ranks other than 0
block on their control socket until the supervisor sends ``wake`` (one per
request, numbered like the request's ``seq``), run lockstep steps until rank 0
broadcasts ``IDLE(seq)``, and block again.

Health: a heartbeat thread sends ``hb`` (step count, seconds spent in the current
step) every ``--hb-interval``; MLX releases the GIL while it computes or waits,
so heartbeats keep flowing from a rank stuck in a dead ring -- the supervisor
sees the step not finishing (mlx issue #3862). If the control socket closes the
rank exits at once (``os._exit``), even from inside a hung collective.

Control protocol: frames of a 4-byte big-endian length and UTF-8 JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

# header fields (int32 vector, broadcast from rank 0 with all_sum)
H_OP, H_SLOT, H_FLAGS, H_N, H_TOK, H_SEQ, H_FREE = range(7)
HEADER = 7
OP_STEP, OP_FREE, OP_IDLE, OP_STOP, OP_BENCH = 1, 2, 3, 4, 5
F_NEW_CACHE, F_HEAD = 1, 2

#: Architectures whose ``Model.__call__`` is ``self.model(...)`` then the output head and
#: nothing else: ranks other than 0 run only ``model.model`` (same collectives, no head).
HEADLESS_OK = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})

MAX_FRAME = 256 << 20
#: Environment variable carrying the group epoch's secret (the supervisor checks it in "hello").
TOKEN_ENV = "RINGLET_TP_TOKEN"  # noqa: S105 - the name of a variable, not a secret
#: All-reduces per bench round (the first round is a warm-up and not counted).
BENCH_ROUND = 20


# ---------------------------------------------------------------------------------------- framing


def encode_frame(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Any | None:
    head = recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is too large")
    body = recv_exact(sock, n)
    return None if body is None else json.loads(body)


class Control:
    """The rank's end of the control socket: a reader thread feeding a queue and a
    locked writer shared by the main and heartbeat threads."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="tp-control-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = recv_frame(self.sock)
                if msg is None:
                    break
                self.inbox.put(msg)
        except (OSError, ValueError):
            pass
        # The supervisor is gone: leave now, even if the main thread is stuck in a collective.
        os._exit(3)

    def send(self, obj: Any) -> None:
        frame = encode_frame(obj)
        with self._lock:
            try:
                self.sock.sendall(frame)
            except OSError:
                os._exit(3)


# ---------------------------------------------------------------------------------------- rank state


@dataclass
class Health:
    step: int = 0
    busy_since: float | None = None
    phase: str = "starting"

    def begin(self) -> None:
        self.busy_since = time.monotonic()

    def end(self) -> None:
        self.step += 1
        self.busy_since = None


@dataclass
class Request:
    id: str
    seq: int
    slot: int
    pending: list[int]
    max_tokens: int
    stop: frozenset[int]
    sampler: Any = None
    kind: str = "gen"  # gen | logits | bench
    produced: int = 0
    started: bool = False
    cancelled: bool = False
    bench_left: int = 0
    bench_width: int = 1
    bench_rounds: list = field(default_factory=list)  # (all-reduces, seconds each)


def heartbeat(ctrl: Control, health: Health, rank: int, interval: float) -> None:
    while True:
        since = health.busy_since
        ctrl.send(
            {
                "t": "hb",
                "rank": rank,
                "step": health.step,
                "phase": health.phase,
                "busy_for": (time.monotonic() - since) if since is not None else 0.0,
            }
        )
        time.sleep(interval)


class Rank:
    def __init__(self, args: argparse.Namespace, ctrl: Control, health: Health):
        self.args = args
        self.ctrl = ctrl
        self.health = health
        self.rank = args.rank
        self.size = args.size
        self.group = None
        self.model = None
        self.inner = None
        self.caches: dict[int, list] = {}

    # -- setup
    def load(self) -> None:
        from .sources import resolve
        from .stage import load_stage

        dtype = None if self.args.dtype in ("", "auto", "model") else self.args.dtype
        stage = load_stage(resolve(self.args.model), 0, None, dtype)
        self.model = stage.model
        self.config = stage.config

    def init_group(self) -> None:
        import mlx.core as mx

        if self.size > 1:
            self.group = mx.distributed.init(backend=self.args.backend, strict=True)
            if self.group.size() != self.size or self.group.rank() != self.rank:
                raise RuntimeError(
                    f"MLX group is rank {self.group.rank()}/{self.group.size()}, expected {self.rank}/{self.size}"
                )
            self.model.shard(self.group)
            mx.eval(self.model.parameters())
            check = mx.distributed.all_sum(mx.ones((1,), dtype=mx.int32), group=self.group)
            mx.eval(check)
            if int(check.item()) != self.size:
                raise RuntimeError(f"group check all_sum gave {int(check.item())}, expected {self.size}")
        model_type = self.config.get("model_type", "")
        inner = getattr(self.model, "model", None)
        self.inner = inner if (model_type in HEADLESS_OK and callable(inner)) else None

    # -- collectives
    def bcast(self, values: list[int] | None, n: int):
        """Rank 0's int32 values of length n on every rank."""
        import mlx.core as mx

        if self.rank == 0:
            arr = mx.array(values, dtype=mx.int32)
        else:
            arr = mx.zeros((n,), dtype=mx.int32)
        if self.group is None:
            return arr
        out = mx.distributed.all_sum(arr, group=self.group)
        mx.eval(out)
        return out

    def step(self, header, tokens: list[int] | None):
        """Run one STEP on this rank; returns logits (rank 0, head requested) or None."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        slot, flags, n = int(header[H_SLOT]), int(header[H_FLAGS]), int(header[H_N])
        if n == 1:
            ids = mx.array([[int(header[H_TOK])]], dtype=mx.int32)
        else:
            ids = self.bcast(tokens, n)[None]
        if flags & F_NEW_CACHE:
            self.caches[slot] = make_prompt_cache(self.model)
        cache = self.caches[slot]
        if self.rank == 0 and flags & F_HEAD:
            out = self.model(ids, cache=cache)
        elif self.inner is not None:
            out = self.inner(ids, cache=cache)
        else:
            out = self.model(ids, cache=cache)
        mx.eval(out)
        return out if (self.rank == 0 and flags & F_HEAD) else None

    def bench(self, iters: int, width: int) -> float:
        import mlx.core as mx

        v = mx.ones((1, 1, width), dtype=mx.float32)
        if self.group is None:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(mx.distributed.all_sum(v, group=self.group))
        return (time.perf_counter() - t0) / iters

    def apply_header(self, header, tokens=None):
        """Run whatever a header says on this rank (all ranks call this in lockstep)."""
        free = int(header[H_FREE])
        if free >= 0:
            self.caches.pop(free, None)
        op = int(header[H_OP])
        if op == OP_STEP:
            return self.step(header, tokens)
        if op == OP_FREE:
            self.caches.pop(int(header[H_SLOT]), None)
        elif op == OP_BENCH:
            return self.bench(int(header[H_N]), int(header[H_TOK]))
        return None

    # -- ranks > 0
    def follow(self) -> None:
        idle_seq = 0
        while True:
            msg = self.ctrl.inbox.get()
            t = msg.get("t")
            if t == "shutdown":
                return
            if t != "wake" or int(msg["seq"]) <= idle_seq:
                continue
            self.health.phase = "lockstep"
            while True:
                self.health.begin()
                header = self.bcast(None, HEADER).tolist()
                op = header[H_OP]
                if op == OP_STOP:
                    return
                self.apply_header(header)
                self.health.end()
                if op == OP_IDLE:
                    idle_seq = header[H_SEQ]
                    break
            self.health.phase = "idle"

    # -- rank 0
    def lead(self) -> None:
        import mlx.core as mx

        from .sampling import RequestSampler, SamplingParams

        reqs: dict[int, Request] = {}
        order: list[int] = []  # round-robin over slots
        next_slot = 0
        accepted_seq = 0
        idle_sent = 0
        to_free: list[int] = []
        chunk = max(1, self.args.prefill_chunk)

        def accept(msg: dict) -> bool:
            nonlocal next_slot, accepted_seq
            t = msg.get("t")
            if t == "shutdown":
                if accepted_seq > idle_sent:  # the others wait in lockstep: release them
                    self.bcast([OP_STOP, 0, 0, 0, 0, 0, -1], HEADER)
                return False
            if t == "cancel":
                for r in reqs.values():
                    if r.id == msg["id"]:
                        r.cancelled = True
                return True
            if t not in ("gen", "logits", "bench"):
                return True
            accepted_seq = max(accepted_seq, int(msg["seq"]))
            slot = next_slot
            next_slot += 1
            if t == "bench":
                reqs[slot] = Request(
                    msg["id"],
                    msg["seq"],
                    slot,
                    [],
                    0,
                    frozenset(),
                    kind="bench",
                    bench_left=int(msg.get("iters", 200)) + BENCH_ROUND,
                    bench_width=int(msg.get("width", 1)),
                )
                order.append(slot)
                return True
            prompt = [int(x) for x in msg["prompt"]]
            if not prompt:
                self.ctrl.send({"t": "error", "id": msg["id"], "msg": "empty prompt"})
                return True
            req = Request(
                msg["id"],
                msg["seq"],
                slot,
                prompt,
                int(msg.get("max_tokens", 0)),
                frozenset(int(x) for x in msg.get("stop", ())),
                kind=t,
            )
            if t == "gen":
                s = msg.get("sampling") or {}
                req.sampler = RequestSampler(
                    SamplingParams(
                        temperature=float(s.get("temperature", 0.0)),
                        top_p=float(s.get("top_p", 1.0)),
                        top_k=int(s.get("top_k", 0)),
                        seed=s.get("seed"),
                    )
                )
                # resumed request: advance the random key past the tokens already drawn
                for _ in range(int(msg.get("skip", 0))):
                    if not req.sampler._greedy:
                        req.sampler._key, _ = mx.random.split(req.sampler._key)
                if req.max_tokens <= 0:
                    self.ctrl.send({"t": "done", "id": req.id, "reason": "length"})
                    return True
            reqs[slot] = req
            order.append(slot)
            return True

        def finish(slot: int, reason: str) -> None:
            r = reqs.pop(slot)
            order.remove(slot)
            if r.started:
                to_free.append(slot)
            if r.kind == "gen" and reason:
                self.ctrl.send({"t": "done", "id": r.id, "reason": reason})

        def run(header: list[int], tokens: list[int] | None = None):
            self.health.begin()
            self.bcast(header, HEADER)
            out = self.apply_header(header, tokens)
            self.health.end()
            return out

        rr = 0
        while True:
            # take new work; block only when there is nothing to do and nobody waits in lockstep
            while True:
                try:
                    msg = self.ctrl.inbox.get(block=not reqs and accepted_seq == idle_sent and not to_free)
                except queue.Empty:
                    break
                if not accept(msg):
                    return
            for slot in [s for s, r in reqs.items() if r.cancelled]:
                finish(slot, "cancelled")
            if not reqs:
                if accepted_seq > idle_sent or to_free:
                    while len(to_free) > 1:  # the others are still in lockstep: free one slot per round
                        run([OP_FREE, to_free.pop(0), 0, 0, 0, 0, -1])
                    free = to_free.pop(0) if to_free else -1
                    run([OP_IDLE, 0, 0, 0, 0, accepted_seq, free])
                    idle_sent = accepted_seq
                self.health.phase = "idle"
                continue
            free = to_free.pop(0) if to_free else -1
            self.health.phase = "lockstep"
            rr %= len(order)
            slot = order[rr]
            rr += 1
            r = reqs[slot]
            if r.kind == "bench":  # short rounds so that no single step looks hung
                k = min(BENCH_ROUND, r.bench_left)
                sec = run([OP_BENCH, slot, 0, k, r.bench_width, 0, free])
                r.bench_rounds.append((k, sec))
                r.bench_left -= k
                if r.bench_left <= 0:
                    timed = r.bench_rounds[1:]  # the first round warms up
                    mean = sum(k * s for k, s in timed) / max(1, sum(k for k, _ in timed))
                    self.ctrl.send({"t": "bench", "id": r.id, "seconds_per_allreduce": mean, "size": self.size})
                    reqs.pop(slot)
                    order.remove(slot)
                continue
            n = len(r.pending) if r.kind == "logits" else min(chunk, len(r.pending))
            feed, r.pending = r.pending[:n], r.pending[n:]
            last = not r.pending
            flags = (0 if r.started else F_NEW_CACHE) | (F_HEAD if last else 0)
            logits = run([OP_STEP, slot, flags, n, feed[0] if n == 1 else 0, 0, free], feed)
            r.started = True
            if not last:
                continue
            if r.kind == "logits":
                arr = logits[0].astype(mx.float32)
                import numpy as np

                data = np.array(arr)
                self.ctrl.send(
                    {
                        "t": "logits",
                        "id": r.id,
                        "shape": list(data.shape),
                        "b64": base64.b64encode(data.tobytes()).decode(),
                    }
                )
                finish(slot, "")
                continue
            tok = r.sampler(logits[0, -1])
            r.produced += 1
            r.pending = [tok]
            self.ctrl.send({"t": "tok", "id": r.id, "ids": [tok], "k": r.produced})
            if tok in r.stop:
                finish(slot, "stop")
            elif r.produced >= r.max_tokens:
                finish(slot, "length")


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
    args = p.parse_args(argv)

    ctrl = Control(args.control)
    health = Health(phase="loading")
    token = os.environ.pop(TOKEN_ENV, "")  # not on the command line: ps shows argv to every user
    ctrl.send({"t": "hello", "token": token, "rank": args.rank, "pid": os.getpid(), "epoch": args.epoch})
    threading.Thread(target=heartbeat, args=(ctrl, health, args.rank, args.hb_interval), daemon=True).start()
    rank = Rank(args, ctrl, health)
    try:
        rank.load()
        ctrl.send({"t": "loaded", "rank": args.rank})
        while True:
            msg = ctrl.inbox.get()
            if msg.get("t") == "shutdown":
                return 0
            if msg.get("t") == "init":
                break
        health.phase = "init"
        health.begin()
        rank.init_group()
        health.end()
        health.phase = "idle"
        ctrl.send(
            {
                "t": "ready",
                "rank": args.rank,
                "size": args.size,
                "backend": args.backend,
                "headless": rank.inner is not None,
            }
        )
        if args.rank == 0:
            rank.lead()
        else:
            rank.follow()
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
