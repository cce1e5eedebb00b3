"""The side channel of a tensor group: rank 0 tells the other ranks what to run next.

Before each model step rank 0 sends every other rank a small binary header over a direct
TCP connection (rank 0 listens, the others connect at ``init``) saying what to run -- feed
these token ids to this request's KV cache, free a cache, stop. All ranks then run the
same collectives in the same order.

Why a side channel and not an ``all_sum`` broadcast: MLX's ring backend waits for a
peer by polling its sockets in a busy loop, so a rank waiting inside a collective
burns a core (two threads for two ranks). Between steps rank 0 samples and talks to
the supervisor, and when idle it waits for requests; the other ranks wait for it in a
blocking ``recv`` on the side channel instead, which costs no CPU. When rank 0 goes
away the side channel closes and the other ranks leave.

Wire format: ``HEADER`` little-endian int32 (op, slot, flags, n, token, arg, free), then
``n`` int32 token ids when ``n > 1`` (steps only), or, with ``F_HIDDEN``, ``arg`` bytes of float32
hidden states ``(1, n, hidden_size)`` whose activation dtype is ``DTYPE_CODES[token]``. A
batched decode step (``OP_BSTEP``, stage mode) carries ``n`` slots: ``n`` int32 slot ids,
then ``n`` int32 token ids or, with ``F_HIDDEN``, hidden states ``(n, 1, hidden_size)``;
the ranks merge the slots' KV caches into mlx-lm's ``BatchKVCache`` for one forward and
split them back.
"""

from __future__ import annotations

import socket
import struct

from ringlet.daemon.tensor.control import recv_exact

# side-channel header fields (int32, little-endian)
H_OP, H_SLOT, H_FLAGS, H_N, H_TOK, H_ARG, H_FREE = range(7)
HEADER = 7
OP_STEP, OP_FREE, OP_STOP, OP_BENCH, OP_BSTEP = 1, 2, 4, 5, 6
#: prefix cache (:mod:`ringlet.daemon.tensor.rank_prefix`): keep the first ``n`` tokens of
#: ``slot``'s cache as entry ``arg``; start ``slot``'s cache from ``n`` tokens of entry
#: ``arg``; forget entry ``arg``
OP_SAVE, OP_LOAD, OP_DROP = 7, 8, 9
#: speculative decoding (:mod:`ringlet.daemon.engine.speculation`): drop the last ``n``
#: positions of ``slot``'s cache (the drafts a verifying step rejected)
OP_TRIM = 10
F_NEW_CACHE, F_HEAD, F_HIDDEN = 1, 2, 4
#: With ``F_HEAD``: rank 0's head projects only the last position onto the vocabulary (a
#: step whose logits are sampled from; ``TPGroup.logits`` asks for every position).
F_LAST = 8
#: Activation dtypes of hidden states on the wire (they travel as float32, which holds each exactly).
DTYPE_CODES = ("float32", "float16", "bfloat16")


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
        if header[H_OP] not in (OP_STEP, OP_BSTEP):
            return 0
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
