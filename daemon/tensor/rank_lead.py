"""Rank 0 of a tensor group: take the supervisor's requests and drive every rank in lockstep.

Rank 0 takes requests (``gen``, ``logits``, ``bench``, ``cancel``) from the supervisor and,
before each model step, tells every other rank over the side channel what to run
(:mod:`ringlet.daemon.tensor.side_channel`). Rank 0 samples
(:class:`ringlet.daemon.engine.sampling.RequestSampler`) and sends each token to the
supervisor as soon as it exists. Requests interleave one step at a time; long prompts are
prefilled in chunks. A ``gen`` request that names a prefix cache scope (``prefix``) starts
from the longest cached prefix of its prompt and is kept as an entry when it ends
(:mod:`ringlet.daemon.tensor.rank_prefix`: rank 0 keeps the index, every rank its shards).

Stage mode (``--layers START:END``, hybrid plans): rank 0 serves ``stage`` requests one at
a time, in order: the input of one forward (token ids on the first stage, hidden states on
the others) for one KV-cache slot, and answers ``out`` with the stage's output (hidden
states, or the last position's logits on the last stage); ``free`` drops a slot's cache.
Sampling, batching and the ring between stages stay with the daemon
(:mod:`ringlet.daemon.tensor.group_stage`).
"""

from __future__ import annotations

import base64
import queue
from dataclasses import dataclass, field
from typing import Any

from ringlet.daemon.tensor.rank import Rank
from ringlet.daemon.tensor.side_channel import (
    DTYPE_CODES,
    F_HEAD,
    F_HIDDEN,
    F_LAST,
    F_NEW_CACHE,
    OP_BENCH,
    OP_BSTEP,
    OP_DROP,
    OP_FREE,
    OP_LOAD,
    OP_SAVE,
    OP_STEP,
    OP_STOP,
    OP_TRIM,
)

#: All-reduces per bench round (the first round is a warm-up and not counted).
BENCH_ROUND = 20


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
    scope: str | None = None  # its prefix cache scope (None: the cache is off for it)
    fed: list[int] = field(default_factory=list)  # the token ids its KV cache holds
    cached: int = 0  # prompt tokens taken from the prefix cache
    drafter: Any = None  # speculative decoding (engine.drafting.Drafter; None: off for it)
    spec: Any = None  # its engine.draft_length.Speculation
    measured: bool = True  # drafts weighed against what a verifying step costs (TripMeter)
    output: list[int] = field(default_factory=list)  # its tokens so far (this epoch's)


class LeadRank(Rank):
    """Rank 0: serves the supervisor's requests and drives the other ranks."""

    _tokenizer: Any = None

    def grammar_tokenizer(self, width: int):
        """llguidance's tokenizer of this model for logits of ``width`` (the model's
        tokenizer is loaded on the first request with a grammar)."""
        from ringlet.daemon.engine.grammar import ll_tokenizer

        if self._tokenizer is None:
            from ringlet.daemon.engine.model_info import load_tokenizer
            from ringlet.daemon.engine.sources import resolve

            self._tokenizer = load_tokenizer(resolve(self.args.model))
        return ll_tokenizer(self._tokenizer._tokenizer, width)

    def lead_stage(self) -> None:
        """Stage mode: run each ``stage`` request as it comes (the daemon's engine orders and
        times them) and answer with the stage's output (every position's logits for a verifying
        step, ``every``); ``free`` drops a slot's cache, ``trim`` its last ``n`` positions; a ``stage``
        request with an ``op`` keeps a slot's cache as a prefix entry (``save``, answered
        with rank 0's bytes) or starts a slot from one (``load``), and ``pdrop`` forgets one."""
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
                    self.groups.dissolve([slot])
                    self.caches.pop(slot, None)
                continue
            if t == "trim":  # a verifying step's rejected drafts leave the slot's cache (every rank)
                header = [OP_TRIM, int(msg["slot"]), 0, int(msg["n"]), 0, 0, -1]
                self.side.send(header)
                self.apply_header(header)
                continue
            if t == "pdrop":  # forget a prefix cache entry (every rank its shard)
                self.side.send([OP_DROP, 0, 0, 0, 0, int(msg["entry"]), -1])
                self.kept.drop(int(msg["entry"]))
                continue
            if t != "stage":
                continue
            if "op" in msg:  # keep a slot's cache as a prefix entry, or start a slot from one
                op = OP_SAVE if msg["op"] == "save" else OP_LOAD
                header = [op, int(msg["slot"]), 0, int(msg["n"]), 0, int(msg["entry"]), -1]
                self.side.send(header)
                value = self.apply_header(header)
                self.ctrl.send({"t": "out", "id": msg["id"], "shape": None, "value": int(value)})
                continue
            head, every = bool(msg.get("head")), bool(msg.get("every"))  # every: all positions' logits
            slots = [int(x) for x in msg["slots"]] if "slots" in msg else [int(msg["slot"])]
            new = bool(msg.get("new")) and "slots" not in msg
            missing = [x for x in slots if x not in self.caches]
            if missing and not new:
                self.ctrl.send({"t": "error", "id": msg["id"],
                                "msg": f"no KV cache for slot {missing[0]} in this group"})
                continue
            slot = slots[0]
            flags = (F_NEW_CACHE if new else 0) | (F_HEAD | (0 if every else F_LAST) if head and self.last else 0)
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
            if self.last and not every:
                out = out[:, -1:, :]  # the last position's logits: all the daemon samples from
            dtype = str(out.dtype).removeprefix("mlx.core.")
            arr = np.array(out.astype(mx.float32))
            self.ctrl.send({"t": "out", "id": msg["id"], "shape": list(arr.shape), "dtype": dtype}, arr.tobytes())

    def lead(self) -> None:
        """Serve ``gen``, ``logits`` and ``bench`` requests, one step of one request at a
        time (round robin). A ``gen`` request with ``spec`` (``{"k", "prediction",
        "measured"}``) decodes speculatively (:mod:`ringlet.daemon.engine.speculation`): each
        decode step feeds the latest token and up to ``k`` drafts, verifies them on every
        position's logits, and has every rank drop the rejected ones (``OP_TRIM``); its
        ``tok`` answers then carry several ids and ``sd`` (drafted, accepted)."""
        import time

        import mlx.core as mx

        from ringlet.daemon.engine.draft_length import Speculation, TripMeter, next_drafts
        from ringlet.daemon.engine.drafting import Drafter
        from ringlet.daemon.engine.sampling import RequestSampler, sampling_from_dict
        from ringlet.daemon.engine.speculation import verify

        meter = TripMeter()  # what a verifying step costs in this group, measured

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
            if t == "gen" and isinstance(msg.get("prefix"), dict):
                index.set_budget(int(msg["prefix"].get("budget", 0)))
                req.scope = str(msg["prefix"].get("scope", "")) if index.budget_bytes > 0 else None
            if t == "gen":
                s = msg.get("sampling") or {}
                try:
                    req.sampler = RequestSampler(sampling_from_dict(s, int(msg.get("skip", 0))), self.grammar_tokenizer)
                except Exception as exc:  # noqa: BLE001 - a grammar that does not compile fails this request only
                    self.ctrl.send({"t": "error", "id": msg["id"], "msg": str(exc)})
                    return True
                if req.max_tokens <= 0:
                    self.ctrl.send({"t": "done", "id": req.id, "reason": "length"})
                    return True
                if isinstance(msg.get("spec"), dict) and int(msg["spec"].get("k", 0)) > 0:
                    req.drafter = Drafter(prompt, [int(x) for x in msg["spec"].get("prediction") or ()])
                    req.spec = Speculation(int(msg["spec"]["k"]))
                    req.measured = bool(msg["spec"].get("measured", True))
            reqs[slot] = req
            order.append(slot)
            return True

        def finish(slot: int, reason: str) -> None:
            r = reqs.pop(slot)
            order.remove(slot)
            if r.started and r.scope is not None and r.fed:  # keep its KV (every rank its shard)
                entry_id = index.next_id()
                index.add(entry_id, r.scope, r.fed, run([OP_SAVE, slot, 0, len(r.fed), 0, entry_id, -1]))
            if r.started:
                to_free.append(slot)
            if r.kind == "gen" and reason:
                self.ctrl.send({"t": "done", "id": r.id, "reason": reason, "prefix": index.info(self.size)})

        def run(header: list[int], tokens: list[int] | None = None):
            self.health.begin()
            self.side.send(header, tokens)
            out = self.apply_header(header, tokens)
            self.health.end()
            return out

        from ringlet.daemon.tensor.rank_prefix import ShardIndex  # imports MLX: after the BLAS (see Rank)

        index = ShardIndex(0, lambda entry: run([OP_DROP, 0, 0, 0, 0, entry.id, -1]))
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
            if not r.started and r.scope is not None:  # reuse the longest cached prefix, one token left
                entry_id, n = index.longest(r.scope, r.pending[:-1])
                loaded = n > 0 and bool(run([OP_LOAD, slot, 0, n, 0, entry_id, free]))
                index.count(n if loaded else 0)
                if loaded:
                    free = -1  # the load's header carried it
                    r.fed, r.pending, r.started, r.cached = r.pending[:n], r.pending[n:], True, n
            n = len(r.pending) if r.kind == "logits" else min(chunk, len(r.pending))
            feed, r.pending = r.pending[:n], r.pending[n:]
            # the latest token alone (a decode step) of a request that drafts
            speculating = r.spec is not None and r.produced > 0 and not r.pending
            drafts: list[int] = []
            if speculating:
                drafts, _ = next_drafts(r.drafter, r.spec, r.output, r.max_tokens - r.produced - 1, r.stop,
                                        meter if r.measured else None)
                feed = feed + drafts
                n = len(feed)
            r.fed += feed
            last = not r.pending
            every = r.kind == "logits" or bool(drafts)  # logits(), a verifying step: every position
            head_flags = F_HEAD | (0 if every else F_LAST)
            flags = (0 if r.started else F_NEW_CACHE) | (head_flags if last else 0)
            began = time.perf_counter()
            logits = run([OP_STEP, slot, flags, n, feed[0] if n == 1 else 0, 0, free], feed)
            if speculating:
                meter.observe(len(drafts), time.perf_counter() - began)
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
            if drafts:  # the accepted drafts, then the model's own next token; the rest leave every cache
                toks = verify(r.sampler, logits[0], feed, r.fed[:-len(feed)])
                keep = len(r.fed) - len(feed) + len(toks)
                if keep < len(r.fed):
                    run([OP_TRIM, slot, 0, len(r.fed) - keep, 0, 0, -1])
                    del r.fed[keep:]
                r.spec.verified(len(drafts), len(toks) - 1, r.drafter.evidence)
                r.drafter.verified(len(toks) - 1)
            else:
                toks = [r.sampler(logits[0, -1], r.fed)]
            r.produced += len(toks)
            r.pending = [int(toks[-1])]
            r.output += [int(t) for t in toks]
            if r.drafter is not None:
                r.drafter.add(int(t) for t in toks)
            self.ctrl.send({"t": "tok", "id": r.id, "ids": [int(t) for t in toks], "k": r.produced,
                            **({"cached": r.cached} if r.produced == len(toks) else {}),
                            **({"sd": [len(drafts), len(toks) - 1]} if drafts else {}),
                            **({"lp": [[t.logprob, list(t.top)] for t in toks]} if toks[0].logprob is not None
                               else {})})
            if toks[-1] in r.stop:
                finish(slot, "stop")
            elif r.produced >= r.max_tokens:
                finish(slot, "length")
