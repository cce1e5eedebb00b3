"""One rank's model and its forward work (every rank of a tensor group runs this).

:class:`Rank` loads the *whole* model with ringlet's loader (``load_stage(loc, 0, None)``)
or, in stage mode (``--layers START:END``, hybrid plans), only the layer range ``[START,
END)``; at ``init`` it joins the MLX group (``mx.distributed.init(backend, strict=True)``),
``model.shard(group)`` splits the weights (a layer range too, so a group is one *stage* of
a pipeline) and one all_sum checks the group. Then it runs whatever a side-channel header
says (:mod:`ringlet.daemon.tensor.side_channel`): one step of a request's KV cache, a
batched decode step of several slots (their caches merged into mlx-lm's ``BatchKVCache``),
a free, an all-reduce bench, or keeping, loading and dropping its shard of a prefix cache
entry (:mod:`ringlet.daemon.tensor.rank_prefix`). Ranks other than 0 :meth:`Rank.follow` rank 0's headers;
rank 0 drives them (:mod:`ringlet.daemon.tensor.rank_lead`).
"""

from __future__ import annotations

import argparse
import time

from ringlet.daemon.tensor.control import Control, Health
from ringlet.daemon.tensor.side_channel import (
    DTYPE_CODES,
    F_HEAD,
    F_HIDDEN,
    F_LAST,
    F_NEW_CACHE,
    H_ARG,
    H_FLAGS,
    H_FREE,
    H_N,
    H_OP,
    H_SLOT,
    H_TOK,
    OP_BENCH,
    OP_BSTEP,
    OP_DROP,
    OP_FREE,
    OP_LOAD,
    OP_SAVE,
    OP_STEP,
    OP_STOP,
    OP_TRIM,
    SideChannel,
)

#: Architectures whose ``Model.__call__`` is ``self.model(...)`` then the output head and
#: nothing else: ranks other than 0 run only ``model.model`` (same collectives, no head).
HEADLESS_OK = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})


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


class Rank:
    """One rank: its (sharded) model, its KV caches by slot and its end of the side channel."""

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
        # imported here, not at the top: it imports MLX, which must come after the worker
        # has loaded the optimized BLAS (ringlet.daemon.probes.blas.load)
        from ringlet.daemon.engine.decode_groups import DecodeGroups
        from ringlet.daemon.tensor.rank_prefix import ShardEntries

        #: this rank's shards of the group's prefix cache entries
        self.kept = ShardEntries()
        #: slots that decode together keep their caches merged (every rank forms the same
        #: groups: all run the same headers); a slot's own cache is whole again (dissolve)
        #: before anything uses it alone
        self.groups = DecodeGroups()
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
        self.groups.dissolve([slot])
        if flags & F_NEW_CACHE:
            self.caches[slot] = make_prompt_cache(self.model)
        cache = self.caches[slot]
        head = self.rank == 0 and bool(flags & F_HEAD)
        out = self._run(x, cache, head, last_only=bool(flags & F_LAST))
        mx.eval(out)
        return out if self.rank == 0 and (head or self.stage_mode) else None

    def _hidden(self, data: bytes, lead: tuple[int, int], header):
        """Hidden states ``lead + (hidden_size,)`` from their float32 wire bytes, in the
        activation dtype the header names (``DTYPE_CODES[header[H_TOK]]``)."""
        import mlx.core as mx
        import numpy as np

        x = mx.array(np.frombuffer(data, dtype=np.float32).reshape(*lead, self.hidden_size))
        return x.astype(getattr(mx, DTYPE_CODES[int(header[H_TOK])]))

    def _run(self, x, cache, head: bool, last_only: bool = False):
        """The model (with its head: over the last position only when ``last_only``), the
        stage's hidden states, or the headless inner model."""
        if head and last_only:
            from ringlet.daemon.engine.prune import last_position_only

            with last_position_only(self.model):
                return self.model(x, cache=cache)
        if head or (self.rank == 0 and self.stage_mode and not self.last):
            return self.model(x, cache=cache)  # a stage that is not the last has no head: hidden states
        if self.inner is not None:
            return self.inner(x, cache=cache)
        return self.model(x, cache=cache)

    def step_batch(self, header, ints: list[int], hidden: bytes | None):
        """One decode step of ``n`` slots as one forward (stage mode), in a decode group
        (:mod:`ringlet.daemon.engine.decode_groups`: their KV caches stay merged in
        left-padded ``BatchKVCache``s while the same slots step together); caches that are
        not plain ``KVCache`` (rotating, quantized) run one slot after another instead.
        Returns rank 0's output ``(n, 1, hidden_size | vocab)`` or None."""
        import mlx.core as mx

        from ringlet.daemon.engine.stage import mergeable

        flags, n = int(header[H_FLAGS]), int(header[H_N])
        slots = ints[:n]
        x = self._hidden(hidden, (n, 1), header) if flags & F_HIDDEN else mx.array([[t] for t in ints[n:]],
                                                                                   dtype=mx.int32)
        head = self.rank == 0 and bool(flags & F_HEAD)
        last_only = bool(flags & F_LAST)
        caches = [self.caches[s] for s in slots]
        out = self.groups.forward(lambda y, merged: self._run(y, merged, head, last_only), slots, x, caches,
                                  mergeable)
        if out is None:
            out = mx.concatenate([self._run(x[i:i + 1], caches[i], head, last_only) for i in range(n)], axis=0)
            mx.eval(out)
        return out if self.rank == 0 and (head or self.stage_mode) else None

    def trims(self) -> bool:
        """Whether this model's KV caches drop drafted positions exactly (every layer is
        mlx-lm's plain ``KVCache``: :func:`ringlet.daemon.engine.speculation.trimmable`);
        speculative decoding runs on the group only then."""
        from mlx_lm.models.cache import make_prompt_cache

        from ringlet.daemon.engine.speculation import trimmable

        return trimmable(make_prompt_cache(self.model))

    def trim(self, slot: int, n: int) -> int:
        """Drop the last ``n`` positions of ``slot``'s cache (a verifying step's rejected
        drafts; mlx-lm's ``trim_prompt_cache``). Returns the positions dropped (0: no such
        cache, or one that cannot trim)."""
        from mlx_lm.models.cache import trim_prompt_cache

        cache = self.caches.get(slot)
        return trim_prompt_cache(cache, n) if cache is not None and n > 0 else 0

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
            self.groups.dissolve([free])
            self.caches.pop(free, None)
        op = int(header[H_OP])
        if op in (OP_SAVE, OP_LOAD, OP_FREE, OP_TRIM):  # these use or replace one slot's own cache
            self.groups.dissolve([int(header[H_SLOT])])
        if op == OP_STEP:
            return self.step(header, tokens, hidden)
        if op == OP_BSTEP:
            return self.step_batch(header, tokens, hidden)
        if op == OP_SAVE:
            return self.kept.save(int(header[H_ARG]), self.caches.get(int(header[H_SLOT])), int(header[H_N]))
        if op == OP_LOAD:
            cache = self.kept.load(int(header[H_ARG]), int(header[H_N]))
            if cache is not None:
                self.caches[int(header[H_SLOT])] = cache
            return cache is not None
        if op == OP_TRIM:
            return self.trim(int(header[H_SLOT]), int(header[H_N]))
        if op == OP_DROP:
            self.kept.drop(int(header[H_ARG]))
        elif op == OP_FREE:
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
