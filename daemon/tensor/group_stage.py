"""A pipeline stage computed by a tensor group: the stage of a hybrid plan's group leader.

In a hybrid plan the pipeline's stages are tensor groups. The group's leader (rank 0's
member) is the stage in the plan: it takes the hops from the previous stage and sends its
output on, exactly like any stage, while the layers themselves run in the group's rank
processes (:class:`ringlet.daemon.tensor.group.TPGroup` with ``layers=(start, end)``), each
holding ``1/size`` of every layer of ``[start, end)``.

:class:`GroupStage` stands where the engine (:class:`ringlet.daemon.engine.scheduler.StageEngine`)
expects a :class:`ringlet.daemon.engine.stage.Stage`: ``make_cache`` hands out a KV-cache *slot*
(the cache itself lives in the ranks), ``__call__`` sends one forward to rank 0 and waits
for its output, and a slot nobody holds any more (the request was released, or the plan
changed) is freed in the ranks. The engine runs it on its worker thread and keeps
everything else: offsets, sampling, the scheduler, the ring. Decode steps that the
scheduler batches go to the group as one batched step (:meth:`GroupStage.forward_many`):
the ranks merge the slots' KV caches into mlx-lm's ``BatchKVCache`` for one forward, as
a pipeline stage does.

The group is started when the plan is committed (:mod:`ringlet.daemon.tensor.serving`) and
attached here; a step that comes before waits for it. When the group restarts (a rank
process crashed, the members still answer) the caches of its earlier epoch are gone:
a step on such a slot raises :class:`ringlet.daemon.engine.scheduler.RequestRetry`, and stage 0
resumes the request on the same plan by prefilling it again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from ringlet.daemon.engine.request_errors import RequestError, RequestRetry
from ringlet.daemon.engine.stage import StageRange
from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.group_errors import TPGroupError, TPStageLost
from ringlet.daemon.tensor.group_prefix import GroupPrefixStore

#: Seconds a step waits for its group to be attached (it starts at commit, ranks load first).
ATTACH_WAIT_S = 120.0


class _Slot:
    """One request's KV cache in the group's ranks (the engine keeps it in ``cache[0]``).

    It answers mlx-lm's trim protocol (``is_trimmable``, ``trim``, as ``trim_prompt_cache``
    calls them), so speculative decoding drops a verifying step's rejected drafts from the
    ranks' caches exactly as from a stage's own (:mod:`ringlet.daemon.engine.speculation`).
    """

    __slots__ = ("__weakref__", "number", "stage")

    #: read by :func:`ringlet.daemon.engine.speculation.trimmable`: trims are exact when the
    #: ranks say their caches are plain ``KVCache`` s (:meth:`is_trimmable`)
    trims_exactly = True

    def __init__(self, number: int, stage: GroupStage):
        self.number = number
        self.stage = stage

    def is_trimmable(self) -> bool:
        """Whether the ranks' caches of this model drop positions exactly (every layer mlx-lm's
        plain ``KVCache``, as every rank reported when the group started); ``False`` while no
        group is attached."""
        group = self.stage.group
        return group is not None and group.trims

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of this slot's cache in every rank (sent ahead of its
        next step, no wait). Returns ``n``."""
        self.stage.trim_slot(self.number, n)
        return n


class GroupStage(StageRange):
    """The layer range ``[start, end)`` of a model, computed by a tensor group.

    Args:
        start, end: the half-open layer range the group holds.
        num_layers: layers in the whole model.
        config: the model config (``hidden_size`` is read).
        loop: the event loop the group lives on (steps come from the engine's thread).
        step_timeout_s: seconds one forward may take once the group runs (a prefill
            chunk of many tokens included); beyond it the step fails.
        prefix_budget_bytes: the budget of its prefix store (:attr:`prefix_store`), bytes
            of KV per rank.
    """

    def __init__(self, start: int, end: int, num_layers: int, config: dict, loop: asyncio.AbstractEventLoop,
                 step_timeout_s: float = 60.0, prefix_budget_bytes: int = 0):
        self.start = start
        self.end = end
        self.num_layers = num_layers
        self.config = config
        self.reused_prefixes: frozenset[str] = frozenset()
        self.loop = loop
        self.step_timeout_s = step_timeout_s
        self.group: TPGroup | None = None
        self._attached = threading.Event()
        self._numbers = itertools.count(1)
        self._epochs: dict[int, int] = {}  # slot -> the group epoch holding its cache
        self._lock = threading.Lock()
        #: the engine's prefix store while this stage serves (the index; the ranks hold the KV)
        self.prefix_store = GroupPrefixStore(self, prefix_budget_bytes)

    def attach(self, group: TPGroup | None) -> None:
        """Run on ``group`` from now on (``None``: the group is gone; steps fail)."""
        self.group = group
        self._attached.set()

    def make_cache(self) -> list:
        """A fresh slot for one request; freed in the ranks once nothing holds it."""
        slot = _Slot(next(self._numbers), self)
        weakref.finalize(slot, self._free, slot.number)
        return [slot]

    def trim_slot(self, number: int, n: int) -> None:
        """Have every rank drop the last ``n`` positions of slot ``number``'s cache (no wait;
        ordered before the slot's next step). Nothing when the slot never ran."""
        with self._lock:
            epoch = self._epochs.get(number)
        group = self.group
        if epoch is not None and group is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(group.trim_slot, number, n, epoch)
            except RuntimeError:
                pass  # the loop closed meanwhile: the ranks are gone too

    def _free(self, number: int) -> None:
        with self._lock:
            epoch = self._epochs.pop(number, None)
        group = self.group
        if epoch is not None and group is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(group.free_slot, number, epoch)
            except RuntimeError:
                pass  # the loop closed meanwhile: the ranks are gone too

    def __call__(self, x: mx.array, cache: list, head: bool | None = True) -> mx.array | None:
        """One forward of this stage for one request (blocks the calling thread).

        Args:
            x: token ids ``(1, tokens)`` int32 on the first stage, hidden states
                ``(1, tokens, hidden_size)`` on the others.
            cache: the request's ``[slot]`` from :meth:`make_cache`.
            head: on the last stage, compute the last position's logits (``False`` for a
                prefill chunk that more chunks follow; ``None``: every position's, a
                verifying step of speculative decoding).

        Returns:
            Hidden states ``(1, tokens, hidden_size)`` in the activation dtype, the
            last position's logits ``(1, 1, vocab)`` float32 on the last stage
            (``(1, tokens, vocab)`` with ``head=None``), or ``None`` there with ``head=False``.

        Raises:
            RequestRetry: the group restarted since this request's cache was made.
            RequestError: no group, the group failed, or the step timed out.
        """
        if x.shape[0] != 1:
            raise RequestError("a tensor-group stage runs one request per forward")
        if not self._attached.wait(ATTACH_WAIT_S) or self.group is None:
            raise RequestError(f"the tensor group of layers [{self.start}, {self.end}) is not running")
        slot = cache[0]
        with self._lock:
            epoch = self._epochs.get(slot.number)
        kwargs: dict[str, Any] = {"head": head}
        if x.ndim == 2:
            kwargs["tokens"] = x[0].tolist()
        else:
            kwargs["hidden"] = np.array(x.astype(mx.float32))
            kwargs["dtype"] = str(x.dtype).removeprefix("mlx.core.")
        ran, out, dtype = self._submit(slot.number, epoch, kwargs)
        with self._lock:
            self._epochs[slot.number] = ran
        if out is None:
            return None
        y = mx.array(out)
        return y if self.last else y.astype(getattr(mx, dtype, mx.float32))

    def forward_many(self, xs: list[mx.array], caches: list[list]) -> list[mx.array | Exception]:
        """One decode step of several requests as one batched forward of the group.

        Args:
            xs: one input per request: token ids ``(1, 1)`` int32 on the first stage,
                hidden states ``(1, 1, hidden_size)`` on the others.
            caches: the requests' ``[slot]`` (each prefilled already).

        Returns:
            Per request, what :meth:`__call__` returns for it, or the exception that
            failed it (requests whose caches belong to an earlier group epoch run alone
            and fail with RequestRetry).
        """
        if not self._attached.wait(ATTACH_WAIT_S) or self.group is None:
            error = RequestError(f"the tensor group of layers [{self.start}, {self.end}) is not running")
            return [error] * len(xs)
        with self._lock:
            epochs = [self._epochs.get(c[0].number) for c in caches]
        if len(set(epochs)) != 1 or epochs[0] is None:  # mixed epochs (a restart in between): one at a time
            return [self._one(x, c) for x, c in zip(xs, caches, strict=True)]
        kwargs: dict[str, Any] = {"head": True}
        if xs[0].ndim == 2:
            kwargs["tokens"] = [int(x[0, 0].item()) for x in xs]
        else:
            kwargs["hidden"] = np.concatenate([np.array(x.astype(mx.float32)) for x in xs], axis=0)
            kwargs["dtype"] = str(xs[0].dtype).removeprefix("mlx.core.")
        try:
            _, out, dtype = self._submit([c[0].number for c in caches], epochs[0], kwargs)
        except RequestError as exc:
            return [exc] * len(xs)
        rows = [mx.array(out[i:i + 1]) for i in range(len(xs))]
        return rows if self.last else [r.astype(getattr(mx, dtype, mx.float32)) for r in rows]

    def _one(self, x: mx.array, cache: list) -> mx.array | Exception:
        try:
            return self(x, cache)
        except RequestError as exc:
            return exc

    def _submit(self, slot: int | list[int], epoch: int | None, kwargs: dict[str, Any]) -> tuple[int, Any, str]:
        """Send one step to the group and wait for it (the calling thread blocks)."""
        future = asyncio.run_coroutine_threadsafe(self.group.stage_forward(slot, epoch, **kwargs), self.loop)
        try:
            return future.result(ATTACH_WAIT_S + self.step_timeout_s)
        except TPStageLost as exc:
            raise RequestRetry(str(exc)) from None
        except TPGroupError as exc:
            raise RequestError(f"tensor group of layers [{self.start}, {self.end}): {exc}") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RequestError(f"tensor group of layers [{self.start}, {self.end}) did not answer") from None

    # --- the prefix store's calls (engine worker thread) ------------------------------------

    def group_epoch(self) -> int | None:
        """The epoch of the attached group (``None``: none attached)."""
        group = self.group
        return group.info()["epoch"] if group is not None else None

    def group_size(self) -> int:
        group = self.group
        return group.info()["size"] if group is not None else 0

    def load_prefix(self, entry: int, epoch: int, n: int) -> list | None:
        """A fresh slot whose caches every rank starts from ``n`` tokens of prefix entry
        ``entry`` (made in group epoch ``epoch``), or ``None`` when the ranks cannot."""
        if self.group is None:
            return None
        cache = self.make_cache()
        try:
            loaded = self._prefix_call("load", cache[0].number, epoch, entry, n)
        except RequestError:
            return None
        if not loaded:
            return None
        with self._lock:
            self._epochs[cache[0].number] = epoch
        return cache

    def save_prefix(self, cache: list, entry: int, n: int) -> tuple[int, int] | None:
        """Have every rank keep ``n`` tokens of this request's slot as prefix entry
        ``entry``: ``(group epoch, rank 0's bytes)``, or ``None`` when it cannot."""
        if self.group is None or not cache or not isinstance(cache[0], _Slot):
            return None
        with self._lock:
            epoch = self._epochs.get(cache[0].number)
        if epoch is None:
            return None
        try:
            return epoch, self._prefix_call("save", cache[0].number, epoch, entry, n)
        except RequestError:
            return None

    def drop_prefix(self, entry: int, epoch: int) -> None:
        """Have every rank forget prefix entry ``entry`` (no wait)."""
        group = self.group
        if group is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(group.drop_prefix, entry, epoch)
            except RuntimeError:
                pass  # the loop closed meanwhile: the ranks are gone too

    def _prefix_call(self, op: str, slot: int, epoch: int, entry: int, n: int) -> int:
        future = asyncio.run_coroutine_threadsafe(self.group.stage_prefix(op, slot, epoch, entry, n), self.loop)
        try:
            return future.result(self.step_timeout_s)
        except (TPStageLost, TPGroupError) as exc:
            raise RequestError(str(exc)) from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RequestError(f"tensor group of layers [{self.start}, {self.end}) did not answer") from None

    def settle(self, cache: list) -> None:
        """Nothing to evaluate: the ranks computed the step already."""

    def nbytes(self) -> int:
        """0: the parameters live in the rank processes (``/v1/cluster`` ``tp.local_ranks``)."""
        return 0

    def loaded_bytes(self) -> int:
        return 0
