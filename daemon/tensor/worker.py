"""One rank of a tensor-parallel group: ``python -m ringlet.daemon.tensor.worker ...``.

Started by :mod:`ringlet.daemon.tensor.group` with MLX's environment already set
(``MLX_RANK`` + ``MLX_HOSTFILE`` for ring; ``MLX_IBV_DEVICES`` +
``MLX_JACCL_COORDINATOR`` for jaccl; see :mod:`ringlet.daemon.tensor.planning`).

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
   (rank 0 listens, the others connect at ``init``) saying what to run -- feed
   these token ids to this request's KV cache, free a cache, stop. All ranks then
   run the same collectives in the same order. Rank 0 samples
   (:class:`ringlet.daemon.engine.sampling.RequestSampler`) and sends each token to the
   supervisor as soon as it exists. Requests interleave one step at a time; long
   prompts are prefilled in chunks.

Why a side channel and not an ``all_sum`` broadcast: MLX's ring backend waits for a
peer by polling its sockets in a busy loop, so a rank waiting inside a collective
burns a core (two threads for two ranks). Between steps rank 0 samples and talks to
the supervisor, and when idle it waits for requests; the other ranks wait for it in a
blocking ``recv`` on the side channel instead, which costs no CPU. When rank 0 goes
away the side channel closes and the other ranks leave.

Health: a heartbeat thread sends ``hb`` (step count, seconds spent in the current
step) every ``--hb-interval``; MLX releases the GIL while it computes or waits,
so heartbeats keep flowing from a rank stuck in a dead ring -- the supervisor
sees the step not finishing (mlx issue #3862). If the control socket closes the
rank exits at once (``os._exit``), even from inside a hung collective.

Stage mode (``--layers START:END``, hybrid plans): the rank loads only the layer range
``[START, END)`` and ``model.shard(group)`` splits it, so a group is one *stage* of a
pipeline. Rank 0 then serves ``stage`` requests one at a time, in order: the input of one
forward (token ids on the first stage, hidden states on the others) for one KV-cache
slot, and answers ``out`` with the stage's output (hidden states, or the last position's
logits on the last stage); ``free`` drops a slot's cache. Sampling, batching and the
ring between stages stay with the daemon (:mod:`ringlet.daemon.tensor.group_stage`).

Control protocol: frames of a 4-byte big-endian length and UTF-8 JSON; a message with
``"bin": n`` is followed by one more length-prefixed frame of ``n`` raw bytes (hidden
states and logits, float32, C order). Side channel: ``HEADER`` little-endian int32 (op,
slot, flags, n, token, arg, free), then ``n`` int32 token ids when ``n > 1``, or, with
``F_HIDDEN``, ``arg`` bytes of float32 hidden states ``(1, n, hidden_size)`` whose
activation dtype is ``DTYPE_CODES[token]``. A batched decode step (``OP_BSTEP``, stage
mode) carries ``n`` slots: ``n`` int32 slot ids, then ``n`` int32 token ids or, with
``F_HIDDEN``, hidden states ``(n, 1, hidden_size)``; the ranks merge the slots' KV caches
into mlx-lm's ``BatchKVCache`` for one forward and split them back.
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

# side-channel header fields (int32, little-endian)
H_OP, H_SLOT, H_FLAGS, H_N, H_TOK, H_ARG, H_FREE = range(7)
HEADER = 7
OP_STEP, OP_FREE, OP_STOP, OP_BENCH, OP_BSTEP = 1, 2, 4, 5, 6
F_NEW_CACHE, F_HEAD, F_HIDDEN = 1, 2, 4
#: Activation dtypes of hidden states on the wire (they travel as float32, which holds each exactly).
DTYPE_CODES = ("float32", "float16", "bfloat16")

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


def encode_message(obj: dict, data: bytes | None = None) -> bytes:
    """A control message, with ``data`` (raw bytes) attached as a second frame when given."""
    if data is None:
        return encode_frame(obj)
    return encode_frame({**obj, "bin": len(data)}) + struct.pack(">I", len(data)) + data


def _recv_raw(sock: socket.socket) -> bytes | None:
    head = recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is too large")
    return recv_exact(sock, n)


def recv_frame(sock: socket.socket) -> Any | None:
    """The next control message (``None`` at end of stream); an attachment is put in ``msg["_data"]``."""
    body = _recv_raw(sock)
    if body is None:
        return None
    msg = json.loads(body)
    if isinstance(msg, dict) and msg.get("bin") is not None:
        data = _recv_raw(sock)
        if data is None:
            return None
        msg["_data"] = data
    return msg


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

    def send(self, obj: Any, data: bytes | None = None) -> None:
        frame = encode_message(obj, data)
        with self._lock:
            try:
                self.sock.sendall(frame)
            except OSError:
                os._exit(3)


class SideChannel:
    """Rank 0's direct line to every other rank: one TCP connection each, rank 0 writes
    step headers, the others block reading them (no CPU while they wait)."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.listener: socket.socket | None = None
        self.peers: list[socket.socket] = []  # rank 0: ranks 1..size-1 in order
        self.leader: socket.socket | None = None  # ranks > 0

    def listen(self, host: str) -> int:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(max(1, self.size))
        return self.listener.getsockname()[1]

    def accept_all(self, timeout: float = 120.0) -> None:
        by_rank: dict[int, socket.socket] = {}
        self.listener.settimeout(timeout)
        while len(by_rank) < self.size - 1:
            conn, _ = self.listener.accept()
            conn.settimeout(timeout)
            head = recv_exact(conn, 4)
            if head is None:
                conn.close()
                continue
            (r,) = struct.unpack("<i", head)
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            by_rank[r] = conn
        self.listener.close()
        self.peers = [by_rank[r] for r in range(1, self.size)]

    def connect(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.leader = socket.create_connection((host, int(port)), timeout=60)
        self.leader.settimeout(None)
        self.leader.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.leader.sendall(struct.pack("<i", self.rank))

    @staticmethod
    def _ints(header: list[int]) -> int:
        """How many int32 follow a header (slot ids and/or token ids)."""
        n, hidden = header[H_N], bool(header[H_FLAGS] & F_HIDDEN)
        if header[H_OP] == OP_BSTEP:
            return n if hidden else 2 * n
        return 0 if hidden or n <= 1 else n

    def send(self, header: list[int], tokens: list[int] | None = None, hidden: bytes | None = None) -> None:
        data = struct.pack(f"<{HEADER}i", *header)
        if (k := self._ints(header)) > 0:
            data += struct.pack(f"<{k}i", *tokens)
        if header[H_FLAGS] & F_HIDDEN:
            data += hidden
        for p in self.peers:
            p.sendall(data)

    def recv(self) -> tuple[list[int], list[int] | None, bytes | None] | None:
        """The next header, its tokens and its hidden states; ``None`` when rank 0 closed the channel."""
        head = recv_exact(self.leader, 4 * HEADER)
        if head is None:
            return None
        header = list(struct.unpack(f"<{HEADER}i", head))
        tokens = hidden = None
        if (k := self._ints(header)) > 0:
            body = recv_exact(self.leader, 4 * k)
            if body is None:
                return None
            tokens = list(struct.unpack(f"<{k}i", body))
        if header[H_FLAGS] & F_HIDDEN:
            hidden = recv_exact(self.leader, header[H_ARG])
            if hidden is None:
                return None
        return header, tokens, hidden


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
        self.side: SideChannel | None = None
        self.caches: dict[int, list] = {}
        self.stage_mode = False
        self.first = self.last = True
        self.hidden_size = 0

    # -- setup
    def load(self) -> None:
        """Load the whole model, or only the layer range ``--layers`` (stage mode)."""
        from ringlet.daemon.engine.sources import resolve
        from ringlet.daemon.engine.stage import load_stage

        dtype = None if self.args.dtype in ("", "auto", "model") else self.args.dtype
        start, end = parse_layers(self.args.layers)
        stage = load_stage(resolve(self.args.model), start, end, dtype)
        self.model = stage.model
        self.config = stage.config
        self.stage_mode = bool(self.args.layers)
        self.first, self.last = stage.first, stage.last
        self.hidden_size = stage.hidden_size

    def open_side(self, host: str) -> int | None:
        """Rank 0: listen for the other ranks' side-channel connections; returns the port."""
        self.side = SideChannel(self.rank, self.size)
        if self.rank == 0 and self.size > 1:
            return self.side.listen(host)
        return None

    def init_group(self, side_address: str | None) -> None:
        import mlx.core as mx

        if self.size > 1:
            if self.rank == 0:
                self.side.accept_all()
            else:
                self.side.connect(side_address)
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

    def step(self, header, tokens: list[int] | None, hidden: bytes | None = None):
        """Run one STEP on this rank; returns the output on rank 0 (logits when the head was
        asked for, hidden states in stage mode) or None."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        slot, flags, n = int(header[H_SLOT]), int(header[H_FLAGS]), int(header[H_N])
        if flags & F_HIDDEN:
            x = self._hidden(hidden, (1, n), header)
        else:
            x = mx.array([[int(header[H_TOK])]] if n == 1 else [tokens], dtype=mx.int32)
        if flags & F_NEW_CACHE:
            self.caches[slot] = make_prompt_cache(self.model)
        cache = self.caches[slot]
        head = self.rank == 0 and bool(flags & F_HEAD)
        out = self._run(x, cache, head)
        mx.eval(out)
        return out if self.rank == 0 and (head or self.stage_mode) else None

    def _hidden(self, data: bytes, lead: tuple[int, int], header):
        """Hidden states ``lead + (hidden_size,)`` from their float32 wire bytes, in the
        activation dtype the header names (``DTYPE_CODES[header[H_TOK]]``)."""
        import mlx.core as mx
        import numpy as np

        x = mx.array(np.frombuffer(data, dtype=np.float32).reshape(*lead, self.hidden_size))
        return x.astype(getattr(mx, DTYPE_CODES[int(header[H_TOK])]))

    def _run(self, x, cache, head: bool):
        """The model (with its head), the stage's hidden states, or the headless inner model."""
        if head or (self.rank == 0 and self.stage_mode and not self.last):
            return self.model(x, cache=cache)  # a stage that is not the last has no head: hidden states
        if self.inner is not None:
            return self.inner(x, cache=cache)
        return self.model(x, cache=cache)

    def step_batch(self, header, ints: list[int], hidden: bytes | None):
        """One decode step of ``n`` slots as one forward (stage mode): their KV caches are
        merged into left-padded ``BatchKVCache``s and split back afterwards; caches that are
        not plain ``KVCache`` (rotating, quantized) run one slot after another instead.
        Returns rank 0's output ``(n, 1, hidden_size | vocab)`` or None."""
        import mlx.core as mx

        from ringlet.daemon.engine.stage import forward_merged, mergeable

        flags, n = int(header[H_FLAGS]), int(header[H_N])
        slots = ints[:n]
        x = self._hidden(hidden, (n, 1), header) if flags & F_HIDDEN else mx.array([[t] for t in ints[n:]],
                                                                                   dtype=mx.int32)
        head = self.rank == 0 and bool(flags & F_HEAD)
        caches = [self.caches[s] for s in slots]
        if mergeable(caches):
            out = forward_merged(lambda y, merged: self._run(y, merged, head), x, caches)
        else:
            out = mx.concatenate([self._run(x[i:i + 1], caches[i], head) for i in range(n)], axis=0)
            mx.eval(out)
        return out if self.rank == 0 and (head or self.stage_mode) else None

    def bench(self, iters: int, width: int) -> float:
        import mlx.core as mx

        v = mx.ones((1, 1, width), dtype=mx.float32)
        if self.group is None:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(mx.distributed.all_sum(v, group=self.group))
        return (time.perf_counter() - t0) / iters

    def apply_header(self, header, tokens=None, hidden=None):
        """Run whatever a header says on this rank (all ranks call this in lockstep)."""
        free = int(header[H_FREE])
        if free >= 0:
            self.caches.pop(free, None)
        op = int(header[H_OP])
        if op == OP_STEP:
            return self.step(header, tokens, hidden)
        if op == OP_BSTEP:
            return self.step_batch(header, tokens, hidden)
        if op == OP_FREE:
            self.caches.pop(int(header[H_SLOT]), None)
        elif op == OP_BENCH:
            return self.bench(int(header[H_ARG]), int(header[H_TOK]))
        return None

    # -- ranks > 0
    def follow(self) -> bool:
        """Serve rank 0's steps; True on STOP, False when rank 0 closed the side channel."""
        self.health.phase = "idle"
        while True:
            got = self.side.recv()  # blocks without CPU until rank 0 has work
            if got is None:
                return False
            if got[0][H_OP] == OP_STOP:
                return True
            header, tokens, hidden = got
            self.health.begin()
            self.health.phase = "lockstep"
            self.apply_header(header, tokens, hidden)
            self.health.end()
            self.health.phase = "idle"

    # -- rank 0
    def lead_stage(self) -> None:
        """Stage mode: run each ``stage`` request as it comes (the daemon's engine orders and
        times them) and answer with the stage's output; ``free`` drops a slot's cache."""
        import mlx.core as mx
        import numpy as np

        while True:
            self.health.phase = "idle"
            msg = self.ctrl.inbox.get()
            t = msg.get("t")
            if t == "shutdown":
                self.side.send([OP_STOP, 0, 0, 0, 0, 0, -1])
                return
            if t == "free":
                slot = int(msg["slot"])
                if slot in self.caches:
                    self.side.send([OP_FREE, slot, 0, 0, 0, 0, -1])
                    self.caches.pop(slot, None)
                continue
            if t != "stage":
                continue
            head = bool(msg.get("head"))
            slots = [int(x) for x in msg["slots"]] if "slots" in msg else [int(msg["slot"])]
            new = bool(msg.get("new")) and "slots" not in msg
            missing = [x for x in slots if x not in self.caches]
            if missing and not new:
                self.ctrl.send({"t": "error", "id": msg["id"],
                                "msg": f"no KV cache for slot {missing[0]} in this group"})
                continue
            slot = slots[0]
            flags = (F_NEW_CACHE if new else 0) | (F_HEAD if head and self.last else 0)
            data: bytes | None = msg.get("_data")
            if "slots" in msg:  # a batched decode step: one token (or hidden state) per slot
                if data is not None:
                    header = [OP_BSTEP, 0, flags | F_HIDDEN, len(slots), DTYPE_CODES.index(msg["dtype"]),
                              len(data), -1]
                    tokens = slots
                else:
                    header = [OP_BSTEP, 0, flags, len(slots), 0, 0, -1]
                    tokens = slots + [int(x) for x in msg["tokens"]]
            elif data is not None:
                n = len(data) // (4 * self.hidden_size)
                header = [OP_STEP, slot, flags | F_HIDDEN, n, DTYPE_CODES.index(msg["dtype"]), len(data), -1]
                tokens = None
            else:
                tokens = [int(x) for x in msg["tokens"]]
                header = [OP_STEP, slot, flags, len(tokens), tokens[0], 0, -1]
            self.health.phase = "lockstep"
            self.health.begin()
            self.side.send(header, tokens, data)
            out = self.apply_header(header, tokens, data)
            self.health.end()
            if self.last and not head:
                self.ctrl.send({"t": "out", "id": msg["id"], "shape": None})  # a prefill chunk: cache only
                continue
            if self.last:
                out = out[:, -1:, :]  # the last position's logits: all the daemon samples from
            dtype = str(out.dtype).removeprefix("mlx.core.")
            arr = np.array(out.astype(mx.float32))
            self.ctrl.send({"t": "out", "id": msg["id"], "shape": list(arr.shape), "dtype": dtype}, arr.tobytes())

    def lead(self) -> None:
        import mlx.core as mx

        from ringlet.daemon.engine.sampling import RequestSampler, SamplingParams

        reqs: dict[int, Request] = {}
        order: list[int] = []  # round-robin over slots
        next_slot = 0
        to_free: list[int] = []
        chunk = max(1, self.args.prefill_chunk)

        def accept(msg: dict) -> bool:
            nonlocal next_slot
            t = msg.get("t")
            if t == "shutdown":
                self.side.send([OP_STOP, 0, 0, 0, 0, 0, -1])
                return False
            if t == "cancel":
                for r in reqs.values():
                    if r.id == msg["id"]:
                        r.cancelled = True
                return True
            if t not in ("gen", "logits", "bench"):
                return True
            slot = next_slot
            next_slot += 1
            if t == "bench":
                reqs[slot] = Request(
                    msg["id"],
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
            self.side.send(header, tokens)
            out = self.apply_header(header, tokens)
            self.health.end()
            return out

        rr = 0
        while True:
            # take new work; block only when there is nothing to do
            while True:
                try:
                    msg = self.ctrl.inbox.get(block=not reqs and not to_free)
                except queue.Empty:
                    break
                if not accept(msg):
                    return
            for slot in [s for s, r in reqs.items() if r.cancelled]:
                finish(slot, "cancelled")
            if not reqs:
                while to_free:  # no collective involved: the others just drop the cache
                    run([OP_FREE, to_free.pop(0), 0, 0, 0, 0, -1])
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
                sec = run([OP_BENCH, slot, 0, 0, r.bench_width, k, free])
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


def parse_layers(text: str | None) -> tuple[int, int | None]:
    """``"START:END"`` -> ``(START, END)``; empty -> ``(0, None)`` (every layer).

    Raises:
        ValueError: not two integers with ``0 <= START < END``.
    """
    if not text:
        return 0, None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--layers must be START:END, got {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--layers {text}: need 0 <= START < END")
    return a, b


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
    if args.exit_with_stdin:
        threading.Thread(target=_exit_on_stdin_eof, name="tp-parent-watch", daemon=True).start()

    ctrl = Control(args.control)
    health = Health(phase="loading")
    token = os.environ.pop(TOKEN_ENV, "")  # not on the command line: ps shows argv to every user
    ctrl.send({"t": "hello", "token": token, "rank": args.rank, "pid": os.getpid(), "epoch": args.epoch})
    threading.Thread(target=heartbeat, args=(ctrl, health, args.rank, args.hb_interval), daemon=True).start()
    rank = Rank(args, ctrl, health)
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
