"""The request plumbing of a tensor group: requests to rank 0, their answers, resumes.

:class:`GroupRequests` (a part of :class:`ringlet.daemon.tensor.group.TPGroup`) sends each
request (``gen``, ``logits``, ``bench``, ``stage``) to the current epoch's rank 0 over its
control connection and queues rank 0's answers for the caller. When the group restarts
(:mod:`ringlet.daemon.tensor.group_epochs`) each request in flight resumes on the new epoch
by re-prefilling prompt + tokens so far (same seed, random key advanced past the tokens
already drawn), so the caller's stream continues where it was; greedy output equals an
undisturbed run.

Stage mode (``layers=(start, end)``, a hybrid plan's group): :meth:`GroupRequests.stage_forward`
runs one forward of the group's layer range -- token ids or hidden states in, hidden states
or the last position's logits out -- for a KV-cache slot the caller names (or one batched
decode step of several slots). The caller (:mod:`ringlet.daemon.tensor.group_stage`) keeps
sampling and the ring; a restart loses the slots' caches, which
:class:`~ringlet.daemon.tensor.group_errors.TPStageLost` reports.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ringlet.daemon.engine.sampling import SamplingParams, Token, sampling_to_dict
from ringlet.daemon.tensor.group_errors import TPGroupError, TPStageLost
from ringlet.daemon.tensor.group_state import Epoch


@dataclass
class Req:
    """One request to the group, as the supervisor follows it across epochs."""

    id: str
    kind: str  # gen | logits | bench
    prompt: list[int]
    max_tokens: int = 0
    sampling: dict = field(default_factory=dict)
    stop: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    data: bytes | None = None  # stage mode: the hidden states attached to the request
    generated: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_epoch: int = -1
    done: bool = False
    resumes: int = 0
    prefix: dict | None = None  # gen: {"scope", "budget"} for rank 0's prefix cache
    info: dict | None = None  # gen: the caller's dict, given "cached_tokens" and "drafts"
    spec: dict | None = None  # gen: speculative decoding ({"k", "prediction", "measured"}), None: off


class GroupRequests:
    """The requests of a :class:`~ringlet.daemon.tensor.group.TPGroup` (its configuration and
    state attributes are set by ``TPGroup.__init__``; the current epoch's ranks and their
    control connections are :class:`~ringlet.daemon.tensor.group_epochs.GroupEpochs`')."""

    # ------------------------------------------------------------------------------------ API

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] = (),
        prefix: dict | None = None,
        info: dict | None = None,
        spec: dict | None = None,
    ) -> AsyncIterator[int]:
        """Token ids as rank 0 produces them; survives group failures (re-prefill).
        Stops after ``max_tokens`` or a token in ``stop_ids`` (which is yielded).

        ``prefix`` (``{"scope": str, "budget": bytes per rank}``) turns rank 0's prefix
        cache on for this request (:mod:`ringlet.daemon.tensor.rank_prefix`); ``info``
        then gets ``cached_tokens``, the prompt tokens taken from it. ``spec``
        (``{"k": most drafts per step, "prediction": expected output ids, "measured":
        bool}``) has rank 0 decode speculatively (exact: the same tokens); ``info["drafts"]``
        then gets (accepted, rejected, verifying steps).

        Raises:
            TPGroupError: the group failed for good.
        """
        sampling = sampling or SamplingParams()
        seed = sampling.seed if sampling.seed is not None else secrets.randbelow(2**31 - 1)
        req = Req(
            id=f"r{next(self._ids)}",
            kind="gen",
            prompt=[int(t) for t in prompt_ids],
            max_tokens=int(max_tokens),
            sampling=sampling_to_dict(replace(sampling, seed=seed)),
            stop=[int(t) for t in stop_ids],
            extra={"steps_done": int(sampling.steps_done)},
            prefix=dict(prefix) if prefix else None,
            info=info,
            spec=dict(spec) if spec else None,
        )
        async for item in self._run(req):
            yield item

    async def logits(self, prompt_ids: Sequence[int]):
        """Logits ``(tokens, vocab)`` float32 (numpy) of one forward pass over ``prompt_ids``."""
        import numpy as np

        req = Req(id=f"l{next(self._ids)}", kind="logits", prompt=[int(t) for t in prompt_ids])
        shape, data = await self._one(req)
        return np.frombuffer(data, dtype=np.float32).reshape(shape)

    async def allreduce_seconds(self, width: int | None = None, iters: int = 200) -> float:
        """Seconds per ``all_sum`` of one ``(1, 1, width)`` float32 vector in the current group
        (default width: the hidden size; 0.0 with one process)."""
        width = width or (self.spec.hidden_size if self.spec else 1) or 1
        req = Req(id=f"b{next(self._ids)}", kind="bench", prompt=[], extra={"iters": iters, "width": width})
        return float(await self._one(req))

    async def stage_forward(self, slot: int | Sequence[int], epoch: int | None, *,
                            tokens: Sequence[int] | None = None, hidden=None, dtype: str = "float32",
                            head: bool | None = True) -> tuple[int, Any, str]:
        """Stage mode: one forward of this group's layer range for one KV-cache slot, or one
        batched decode step of several.

        Args:
            slot: the request's cache slot (any int the caller keeps unique), or a list of
                ``n`` slots for a batched decode step (one token each; their caches exist).
            epoch: the group epoch the slot's (slots') cache was created in, ``None`` to
                create it now (the first prefill chunk of one slot).
            tokens: token ids (first stage: the chunk's, or one per slot), or
            hidden: hidden states, float32 numpy ``(1, tokens, hidden_size)`` (``(n, 1,
                hidden_size)`` for a batch), whose activation dtype is ``dtype`` (float32,
                float16 or bfloat16).
            head: on the last stage, compute the logits of the last position (``False``: a
                prefill chunk that only fills the cache; ``None``: every position's, a
                verifying step of speculative decoding, one slot).

        Returns:
            ``(epoch, out, dtype)``: the group epoch that ran it; float32 numpy hidden
            states ``(1, tokens, hidden_size)``, or the last position's logits
            ``(1, 1, vocab)`` on the last stage (``(1, tokens, vocab)`` when ``head`` is
            ``None``, ``None`` when it is false; the first axis is the slot for a batch);
            and the activation dtype the ranks computed in (``"float32"``, ``"bfloat16"``, ...).

        Raises:
            TPStageLost: the group restarted since ``epoch`` (the slot's cache is gone).
            TPGroupError: the group failed or closed, or the rank refused the step.
        """
        import numpy as np

        if self.layers is None:
            raise TPGroupError("stage_forward needs a group started with layers=(start, end)")
        if isinstance(slot, int):
            extra: dict[str, Any] = {"slot": int(slot), "new": epoch is None, "head": head is None or bool(head),
                                     "epoch": epoch}
            if head is None:
                extra["every"] = True
        else:
            if epoch is None:
                raise ValueError("a batched step needs the slots' group epoch")
            extra = {"slots": [int(x) for x in slot], "head": bool(head), "epoch": epoch}
        data = None
        if hidden is not None:
            data = np.ascontiguousarray(hidden, dtype=np.float32).tobytes()
            extra["dtype"] = dtype
        else:
            extra["tokens"] = [int(t) for t in tokens]
        req = Req(id=f"s{next(self._ids)}", kind="stage", prompt=[], extra=extra, data=data)
        shape, out, out_dtype, _ = await self._one(req)
        ran = req.sent_epoch
        if shape is None:
            return ran, None, out_dtype
        return ran, np.frombuffer(out, dtype=np.float32).reshape(shape), out_dtype

    async def stage_prefix(self, op: str, slot: int, epoch: int, entry: int, n: int) -> int:
        """Stage mode, prefix cache (:mod:`ringlet.daemon.tensor.rank_prefix`): every rank keeps
        the first ``n`` tokens of ``slot``'s cache as ``entry`` (``op="save"``; returns rank
        0's bytes, 0 when nothing was kept), or starts ``slot``'s cache from ``n`` tokens of
        ``entry`` (``op="load"``; returns 1 when loaded, 0 when the ranks lack it). ``epoch``
        is the group epoch that holds the slot (save) or the entry (load).

        Raises:
            TPStageLost: the group restarted since ``epoch``.
            TPGroupError: the group failed or closed.
        """
        if op not in ("save", "load"):
            raise ValueError(f"unknown prefix op {op!r}")
        extra = {"op": op, "slot": int(slot), "entry": int(entry), "n": int(n), "epoch": epoch}
        req = Req(id=f"p{next(self._ids)}", kind="stage", prompt=[], extra=extra)
        _, _, _, value = await self._one(req)
        return int(value or 0)

    def drop_prefix(self, entry: int, epoch: int) -> None:
        """Stage mode: every rank forgets prefix entry ``entry`` (nothing when ``epoch`` is gone)."""
        ep = self._epoch
        if ep is not None and ep.number == epoch and self.state == "ready" and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "pdrop", "entry": int(entry)})

    def trim_slot(self, slot: int, n: int, epoch: int) -> None:
        """Stage mode: drop the last ``n`` positions of a slot's KV cache on every rank (a
        verifying step's rejected drafts; nothing when ``epoch`` is gone). Sent on the control
        connection the slot's next step follows, so rank 0 applies it first."""
        ep = self._epoch
        if ep is not None and ep.number == epoch and self.state == "ready" and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "trim", "slot": int(slot), "n": int(n)})

    def free_slot(self, slot: int, epoch: int) -> None:
        """Stage mode: drop a slot's KV cache on every rank (nothing when ``epoch`` is gone)."""
        ep = self._epoch
        if ep is not None and ep.number == epoch and self.state == "ready" and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "free", "slot": int(slot)})

    # ------------------------------------------------------------------------------------ requests

    async def _one(self, req: Req) -> Any:
        async with contextlib.aclosing(self._run(req)) as items:
            async for item in items:
                return item
        raise TPGroupError(f"no answer to {req.kind} request")

    async def _run(self, req: Req):
        if self.state in ("closed", "failed"):
            raise TPGroupError(f"tensor group is {self.state}: {self.reason}")
        self._reqs[req.id] = req
        try:
            self._send_req(req)
            while True:
                item = await req.queue.get()
                if isinstance(item, tuple) and item and item[0] == "done":
                    return
                if isinstance(item, tuple) and item and item[0] == "error":
                    raise TPGroupError(item[1])
                if isinstance(item, tuple) and item and item[0] == "lost":
                    raise TPStageLost(item[1])
                yield item
                if req.kind != "gen":
                    return
        finally:
            self._reqs.pop(req.id, None)
            if not req.done:
                req.done = True
                self._cancel(req)

    def _send_req(self, req: Req) -> None:
        ep = self._epoch
        if ep is None or self.state != "ready" or req.done or req.sent_epoch == ep.number:
            return
        if req.kind == "gen" and (
            len(req.generated) >= req.max_tokens or (req.generated and req.generated[-1] in req.stop)
        ):
            req.done = True  # finished just before the failure; only the "done" was lost
            req.queue.put_nowait(("done", "stop" if req.generated and req.generated[-1] in req.stop else "length"))
            return
        msg: dict[str, Any] = {"t": req.kind, "id": req.id}
        if req.kind == "stage":
            e = req.extra
            if req.sent_epoch >= 0 or (e["epoch"] is not None and e["epoch"] != ep.number):
                req.done = True  # the caches of the epoch it belongs to are gone
                req.queue.put_nowait(("lost", f"tensor group restarted (epoch {ep.number}): "
                                              "this request's KV cache is gone"))
                return
            msg.update({k: v for k, v in e.items() if k != "epoch"})
            req.sent_epoch = ep.number
            self._write(ep.ranks[0], msg, req.data)
            return
        if req.kind == "gen":
            msg.update(
                prompt=req.prompt + req.generated,
                max_tokens=req.max_tokens - len(req.generated),
                sampling=req.sampling,
                stop=req.stop,
                skip=len(req.generated) + int(req.extra.get("steps_done", 0)),
            )
            if req.prefix:
                msg["prefix"] = req.prefix
            if req.spec:
                msg["spec"] = req.spec
        elif req.kind == "logits":
            msg.update(prompt=req.prompt)
        else:
            msg.update(req.extra)
        req.sent_epoch = ep.number
        self._write(ep.ranks[0], msg)

    def _cancel(self, req: Req) -> None:
        ep = self._epoch
        if req.kind == "stage":
            return  # one step: rank 0 finishes it; the slot is freed by free_slot
        if ep is not None and req.sent_epoch == ep.number and ep.ranks and not ep.failed.is_set():
            self._write(ep.ranks[0], {"t": "cancel", "id": req.id})

    # ------------------------------------------------------------------------------------ epoch hooks

    def _resume_requests(self, ep: Epoch) -> None:
        """``ep`` serves: send it the requests in flight (those of a failed epoch resume)."""
        for req in list(self._reqs.values()):
            if (req.kind != "stage" and not req.done and req.sent_epoch >= 0
                    and req.sent_epoch != ep.number):
                req.resumes += 1
                if req.resumes > self.max_resumes:  # it may be what kills the group
                    req.done = True
                    req.queue.put_nowait(
                        ("error", f"request interrupted {req.resumes} times: {self._last_why}")
                    )
                    continue
            self._send_req(req)

    def _fail_requests(self, why: str) -> None:
        """The group failed for good: end every request in flight with ``why``."""
        for req in list(self._reqs.values()):
            if not req.done:
                req.done = True
                req.queue.put_nowait(("error", why))

    def _on_answer(self, t: str, msg: dict) -> None:
        """Rank 0 answered a request (``tok``, ``done``, ``logits``, ``bench``, ``error``, ``out``)."""
        if t == "done" and isinstance(msg.get("prefix"), dict):
            self.prefix_info = msg["prefix"]  # also when the caller stopped reading first
        req = self._reqs.get(msg.get("id", ""))
        if req is None or req.done:
            return
        if t == "tok":
            if "cached" in msg and req.info is not None:
                req.info.setdefault("cached_tokens", int(msg["cached"]))
            if "sd" in msg and req.info is not None:  # a verifying step: (drafted, accepted)
                accepted, rejected, trips = req.info.get("drafts", (0, 0, 0))
                drafted, took = (int(x) for x in msg["sd"])
                req.info["drafts"] = (accepted + took, rejected + drafted - took, trips + 1)
            scores = msg.get("lp") or [None] * len(msg["ids"])
            for tok, score in zip(msg["ids"], scores, strict=True):
                req.generated.append(int(tok))
                req.queue.put_nowait(Token(int(tok), float(score[0]), tuple((int(i), float(v)) for i, v in score[1]))
                                     if score else int(tok))
        elif t == "done":
            req.done = True
            req.queue.put_nowait(("done", msg.get("reason")))
        elif t == "logits":
            req.done = True
            req.queue.put_nowait((tuple(msg["shape"]), base64.b64decode(msg["b64"])))
        elif t == "bench":
            req.done = True
            req.queue.put_nowait(msg["seconds_per_allreduce"])
        elif t == "out":
            req.done = True
            shape = msg.get("shape")
            req.queue.put_nowait((tuple(shape) if shape is not None else None, msg.get("_data"),
                                  str(msg.get("dtype") or "float32"), msg.get("value")))
        else:
            req.done = True
            req.queue.put_nowait(("error", msg.get("msg", "error")))
