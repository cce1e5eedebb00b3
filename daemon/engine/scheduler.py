"""The sharded engine of one node: a stage, per-request KV caches, one MLX worker thread,
and the scheduler that batches the decode steps of concurrent requests.

All MLX work (loading, forward passes, sampling, tensor encoding and decoding) runs
on a single worker thread, so the asyncio event loop never blocks on compute and
MLX state is touched by one thread only.

A request's KV cache lives here from its prefill (step 0) until it is released;
every forward checks that the sender's ``offset`` equals the number of tokens in the
cache, so a desynchronised ring fails the request instead of computing garbage.

Scheduling (:meth:`StageEngine.submit`): work waits in one first-come-first-served
queue. Each round the scheduler takes the oldest item. A multi-token step (a prefill
chunk; stage 0 cuts long prompts into chunks, see :mod:`ringlet.daemon.node`) runs
alone, so a long prefill holds the worker one chunk at a time and the decode steps of
other requests run between its chunks. A one-token step (a decode step) runs in one
batched forward with the steps :func:`.batching.choose_batch` picks, in a *decode
group* (:mod:`.decode_groups`): requests that step together keep their KV caches
merged from one step to the next. A release overtakes the queue: it drops the
request's waiting work too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ringlet.daemon.engine import cache_kinds, kv_handoff, speculation
from ringlet.daemon.engine.batching import Work, batch_figures, choose_batch
from ringlet.daemon.engine.boundary import Boundary, BoundaryStore, Recording
from ringlet.daemon.engine.decode_groups import DecodeGroups
from ringlet.daemon.engine.defaults import DEFAULT_GROUP_WAIT_S, DEFAULT_MAX_BATCH
from ringlet.daemon.engine.kv_room import KVRoom
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.request_errors import PrefixMiss, RequestDropped, RequestError
from ringlet.daemon.engine.sampling import GrammarTokenizer, RequestSampler, SamplingParams
from ringlet.daemon.engine.stage import Stage, StageRange, mergeable, token_id_error
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    cache: list
    sampler: RequestSampler | None
    offset: int = 0
    scope: str = ""
    #: the ids of the tokens in ``cache`` (``None``: unknown, a sender that did not say),
    #: so that its KV can move with its layers on a re-plan
    tokens: list[int] | None = None
    #: the hidden states this stage sent on for it (``None``: not all of them are kept)
    boundary: Recording | None = None
    #: the offset before its latest verifying step while it may hold rejected drafts
    drafted_from: int | None = None


class StageEngine:
    """Runs one stage for many requests, batching their decode steps.

    Args:
        stage: the loaded stage (built on the worker thread via :meth:`create`): a
            :class:`Stage`, or a tensor group's stage (``tensor.group_stage.GroupStage``);
            both are :class:`StageRange` with ``make_cache``, ``__call__``, ``forward_many`` and ``settle``.
        executor: the single-thread executor that owns MLX.
        max_tensor_bytes: the largest incoming hidden-states payload accepted, bytes.
        max_batch: the most decode steps run as one forward (1 = no batching: one
            request per forward, each bit-identical to running it alone).
        prefix: the stage's prefix store (default: one with no budget, holding nothing).
        boundaries: the hidden states a stage that is not last sent on, kept to rebuild
            the next layers' KV if their node is lost (default: a store with no budget).
        group_wait_s: the longest a decode step waits, seconds, for the rest of its batch
            (its decode group, or the batch the previous stage named) to arrive.

    Attributes:
        ring_depth: stages in the plan served (set by the node): stage 0 forms at most
            ``ceil(requests / ring_depth)``-request batches.
    """

    def __init__(self, stage: StageRange | None, executor: concurrent.futures.ThreadPoolExecutor,
                 max_tensor_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES, max_batch: int = DEFAULT_MAX_BATCH,
                 prefix: PrefixStore | None = None, boundaries: BoundaryStore | None = None,
                 group_wait_s: float = DEFAULT_GROUP_WAIT_S):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.stage = stage
        self.executor = executor
        self.max_tensor_bytes = max_tensor_bytes
        self.max_batch = max_batch
        self.group_wait_s = group_wait_s
        self.ring_depth = 1
        self._groups = DecodeGroups()
        #: request id -> the requests its latest step was computed with (itself included)
        self._batch_of: dict[str, tuple[str, ...]] = {}
        # the prefix store of a layer stage (finished requests' KV, by token ids)
        self._prefix = prefix if prefix is not None else PrefixStore(0)
        self.boundaries = boundaries if boundaries is not None else BoundaryStore(0)
        if isinstance(stage, Stage):
            self.boundaries.retain(stage.end)
        self._requests: dict[str, _RequestState] = {}
        self._queue: deque[Work] = deque()
        self._wakeup: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        #: decode batch size -> forwards run with that many requests (since start)
        self.batch_histogram: Counter[int] = Counter()
        #: (monotonic time, batch size) of recent decode forwards
        self.recent_batches: deque[tuple[float, int]] = deque(maxlen=256)
        self.last_batch = 0
        #: supplies llguidance's tokenizer and the logits width, for requests with a grammar
        self.grammar_tokenizer: GrammarTokenizer | None = None
        #: the memory this stage's KV may take (set by the node; None: unchecked)
        self.kv_room: KVRoom | None = None
        #: (rounds run, their seconds in all) since start: /metrics' step time
        self.step_seconds: tuple[int, float] = (0, 0.0)

    @staticmethod
    def new_executor() -> concurrent.futures.ThreadPoolExecutor:
        """The single MLX worker thread of a node."""
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")

    @classmethod
    async def create(cls, loader: Callable[[], Stage],
                     executor: concurrent.futures.ThreadPoolExecutor | None = None, **kwargs: Any) -> StageEngine:
        """Load a stage on the worker thread (a fresh one unless given) and wrap it."""
        executor = executor or cls.new_executor()
        stage = await asyncio.get_running_loop().run_in_executor(executor, loader)
        return cls(stage, executor, **kwargs)

    @property
    def active_requests(self) -> list[str]:
        """Ids of the requests holding a KV cache on this stage."""
        return list(self._requests)

    def tokens_in_flight(self) -> int:
        """Tokens in the KV caches of the requests in flight here (read from any thread)."""
        return sum(state.offset for state in list(self._requests.values()))

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV caches of the requests in flight on this stage (not the
        prefix store's entries)."""
        own = sum(cache_kinds.nbytes(list(state.cache)) for state in list(self._requests.values()))
        return own + self._groups.nbytes()

    def batch_of(self, request_id: str) -> tuple[str, ...]:
        """The requests the latest step of ``request_id`` was computed with, itself
        included, in one forward (read on the event loop once the step's future is
        done; sent on as ``Activation.batch_ids``)."""
        return self._batch_of.get(request_id, (request_id,))

    @property
    def queued(self) -> int:
        """Steps waiting for the worker."""
        return len(self._queue)

    async def run(self, fn: Callable, *args: Any):
        """Run ``fn(*args)`` on the MLX worker thread (outside the scheduler's queue)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # --- scheduler (event loop) -----------------------------------------------------------

    def submit(self, request_id: str, step: int, offset: int, payload: list[int] | pb.Tensor,
               sampling: SamplingParams | None, more: bool = False, prefix_ids: list[int] | None = None,
               scope: str = "", ids: list[int] | None = None,
               siblings: list[str] | None = None, drafts: int = 0) -> asyncio.Future:
        """Queue one forward of this stage for one request.

        Args:
            request_id: the request.
            step: 0 for the prefill (its first chunk, at offset 0, creates the KV
                cache), n for the n-th decode step.
            offset: tokens already in the request's KV cache (must match).
            payload: token ids on the first stage; a Tensor message with hidden states
                ``(1, tokens, hidden_size)`` on the others.
            sampling: the request's sampling parameters (used when the last stage
                creates the request's cache).
            more: a prefill chunk that more chunks follow: the last stage fills its
                cache and samples nothing.
            prefix_ids: on a request's first chunk with ``offset`` > 0, the ``offset`` token
                ids its KV cache starts from, taken from the prefix store.
            scope: the request's prefix cache scope (first chunk).
            ids: on a later stage, the token ids ``payload``'s hidden states stand for
                (``Activation.token_ids``); the request's cache then knows its tokens.
            siblings: on a later stage, the requests the previous stage computed this
                step with (``Activation.batch_ids``); this stage batches the same ones.
            drafts: a verifying step's drafted tokens, last in its payload (:mod:`.speculation`).

        Returns:
            A future with hidden states ``(1, tokens, hidden_size)`` for the next stage,
            the sampled token id on the last stage (a verifying step's accepted drafts
            then next token, a list), or ``None`` there for a chunk with ``more``. Its exception:
            codec.TensorDecodeError (malformed hidden states), RequestError (unknown
            request or offset mismatch), RequestDropped (released, or the plan
            changed, before the step ran), PrefixMiss (the store lacks ``prefix_ids``).
        """
        work = Work(request_id, asyncio.get_running_loop().create_future(), step, offset, payload, sampling, more,
                     prefix_ids=list(prefix_ids) if prefix_ids else None, scope=scope,
                     ids=list(ids) if ids is not None else None,
                     siblings=tuple(siblings) if siblings else None, queued_at=time.monotonic(), drafts=drafts)
        self._enqueue(work)
        return work.future

    def submit_release(self, request_id: str, token_ids: list[int] | None = None) -> asyncio.Future:
        """Drop a request's KV cache and any of its steps still waiting, after the step
        running now (if any); with ``token_ids`` (every token in the cache, and maybe
        more), keep the cache in the prefix store first. The future's result says
        whether a cache was held."""
        work = Work(request_id, asyncio.get_running_loop().create_future(), release=True,
                     token_ids=list(token_ids) if token_ids else None)
        self._enqueue(work)
        return work.future

    async def swap_stage(self, stage: Stage | None, keep: bool = False) -> tuple[list, list[Boundary]]:
        """Serve ``stage`` from now on: waiting steps are dropped (their requests belong
        to the old plan) and every KV cache goes (see :meth:`swap`); with ``keep``, it
        comes back as :class:`~ringlet.daemon.engine.kv_pieces.Piece` s first, with the
        boundary activations the old stage held."""
        self._drop(lambda w: True, "the plan changed")
        return await self.run(self.swap, stage, keep)

    def _enqueue(self, work: Work) -> None:
        self._queue.append(work)
        if self._dispatcher is None or self._dispatcher.done():
            self._wakeup = asyncio.Event()
            self._dispatcher = asyncio.ensure_future(self._dispatch())
        self._wakeup.set()

    def _drop(self, which: Callable[[Work], bool], why: str) -> None:
        keep: deque[Work] = deque()
        for work in self._queue:
            if work.release or not which(work):
                keep.append(work)
            elif not work.future.done():
                work.future.set_exception(RequestDropped(f"request {work.request_id}: {why}"))
        self._queue = keep

    def _take_round(self) -> tuple[list[Work], list[Work], float]:
        """Releases to apply now, the steps of the next forward, and (when that is
        empty) how long to wait, seconds, for the rest of the first step's batch."""
        releases = [w for w in self._queue if w.release]
        if releases:
            released = {w.request_id for w in releases}
            self._queue = deque(w for w in self._queue if not w.release)
            self._drop(lambda w: w.request_id in released, "released")
        if not self._queue:
            return releases, [], 0.0
        cap = min(self.max_batch, max(1, -(-len(self._requests) // max(1, self.ring_depth))))
        batch, wait = choose_batch(self._queue, self._groups.members, self._requests, self.max_batch, cap,
                                   self.group_wait_s, time.monotonic())
        taken = {id(w) for w in batch}
        self._queue = deque(w for w in self._queue if id(w) not in taken)
        return releases, batch, wait

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            releases, batch, wait = self._take_round()
            if releases:
                try:
                    held = await loop.run_in_executor(self.executor, self._release_many, releases)
                except Exception as exc:  # noqa: BLE001 - reported to each waiter
                    held = [exc] * len(releases)
                for work, result in zip(releases, held, strict=True):
                    _resolve(work.future, result)
            if batch:
                started = time.perf_counter()
                try:
                    results = await loop.run_in_executor(self.executor, self._run_batch, batch)
                except Exception as exc:  # noqa: BLE001 - the worker itself failed; fail these steps only
                    log.exception("stage forward failed")
                    results = self._out_of_memory([exc] * len(batch))
                self.step_seconds = (self.step_seconds[0] + 1, self.step_seconds[1] + time.perf_counter() - started)
                for work, result in zip(batch, results, strict=True):
                    _resolve(work.future, result)
            elif wait > 0:  # the rest of the first step's batch is on its way
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), wait)

    @property
    def prefix(self) -> PrefixStore:
        """The prefix store of the stage served now: the stage's own when it has one (a
        tensor group's, :class:`ringlet.daemon.tensor.group_prefix.GroupPrefixStore`, whose
        ranks hold the KV), else this engine's (finished requests' KV, by token ids)."""
        own = getattr(self.stage, "prefix_store", None)
        return own if own is not None else self._prefix

    # --- worker-thread functions ---------------------------------------------------------

    def swap(self, stage: Stage | None, keep: bool = False) -> tuple[list, list[Boundary]]:
        """Serve ``stage`` from now on (worker thread); every KV cache of the old stage goes.
        With ``keep``, its requests in flight (less unconfirmed drafts) and prefix entries come back
        first as pieces (:func:`ringlet.daemon.engine.kv_handoff.park`), with its boundary
        activations; without, the store keeps what covers the new range."""
        self._groups.dissolve_all()
        self._batch_of.clear()
        for state in self._requests.values():
            speculation.drop_unconfirmed(state, self.boundaries)
        parked = kv_handoff.park(self.stage, self._requests, self._prefix) if keep else []
        boundaries = kv_handoff.park_boundaries(self._requests, self.boundaries,
                                                stage.end if isinstance(stage, Stage) else None)
        self.stage = stage
        self._requests.clear()
        if isinstance(stage, Stage):
            self._prefix.retain(stage.start, stage.end)
        else:
            self._prefix.clear()  # no layers here (a tensor plan), or a tensor group's stage (its own store)
        mx.clear_cache()
        return parked, boundaries if keep else []

    def kv_pieces(self) -> list:
        """The KV held now, as pieces (worker thread); nothing is dropped."""
        self._groups.dissolve_all()
        return kv_handoff.park(self.stage, self._requests, self._prefix, clear=False)

    def _state(self, work: Work) -> _RequestState:
        request_id, step, offset, sampling = work.request_id, work.step, work.offset, work.sampling
        if self.stage is None:
            raise RequestError("this node holds no stage of the current plan")
        if step == 0 and (offset == 0 or work.prefix_ids):
            self._groups.dissolve([request_id])  # the id's old cache, if it was still held
            if offset == 0:
                cache = self.stage.make_cache()
            elif len(work.prefix_ids) != offset:
                raise RequestError(f"request {request_id}: {len(work.prefix_ids)} prefix ids for offset {offset}")
            elif (cache := self.prefix.take(work.scope, work.prefix_ids)) is None:
                holds = self.prefix.longest(work.scope, work.prefix_ids)
                raise PrefixMiss(f"request {request_id}: the prefix store holds {holds} of the {offset} "
                                 "prefix tokens", holds)
            sampler = RequestSampler(sampling or SamplingParams(), self.grammar_tokenizer) if self.stage.last else None
            state = _RequestState(cache=cache, sampler=sampler, offset=offset, scope=work.scope,
                                  tokens=list(work.prefix_ids or ()))
            if isinstance(self.stage, Stage) and not self.stage.last:
                state.boundary = self.boundaries.begin(work.scope, work.prefix_ids or [])
            self._requests[request_id] = state
            return state
        state = self._requests.get(request_id)
        if state is None:
            raise RequestError(f"request {request_id}: no KV cache on this stage (not prefilled or released)")
        if state.offset != offset and not speculation.roll_back(state, offset, self.boundaries):
            raise RequestError(
                f"request {request_id}: offset {offset} does not match the {state.offset} tokens in its KV cache"
            )
        return state

    def _input(self, payload: list[int] | pb.Tensor) -> mx.array:
        if isinstance(payload, list):
            if self.stage.first and (error := token_id_error(payload, self.stage.config.get("vocab_size"))):
                raise RequestError(error)
            return mx.array([payload], dtype=mx.int32)
        x = codec.decode(payload, max_bytes=self.max_tensor_bytes, require_finite=True)
        if (error := self.shape_error(tuple(x.shape))) is not None:
            raise codec.TensorDecodeError(error)
        return x

    def shape_error(self, shape: tuple[int, ...]) -> str | None:
        """Why hidden states of ``shape`` cannot enter this stage (it takes
        ``(1, tokens, hidden_size)``), or ``None`` (also when no stage is loaded)."""
        if self.stage is None:
            return None
        hidden = self.stage.hidden_size
        if len(shape) != 3 or shape[0] != 1 or shape[2] != hidden:
            return f"hidden states must have shape (1, tokens, {hidden}), got {shape}"
        return None

    def _finish_one(self, state: _RequestState, out: mx.array, tokens: int, more: bool, drafts: int = 0) -> Any:
        state.offset += tokens
        state.drafted_from = state.offset - tokens if drafts else None
        if not self.stage.last:
            state.boundary = self.boundaries.record(state.boundary, out)
            return codec.encode(out)
        if more:
            self.stage.settle(state.cache)  # fill the cache; the logits are never computed
            return None
        if drafts:
            return speculation.finish_verify(state, out, tokens, self.boundaries)
        return state.sampler(out[0, -1], state.tokens or ())

    def _run_batch(self, batch: list[Work]) -> list[Any]:
        """Run the steps of one round (worker thread): one multi-token step, or up to
        ``max_batch`` one-token steps of different requests as one forward. Returns
        each step's result or exception, in order."""
        results: list[Any] = [None] * len(batch)
        ready: list[tuple[int, _RequestState, mx.array]] = []
        room = self.kv_room
        if room is not None:  # this round's KV growth must fit the stage's memory (engine/kv_room.py)
            kv, held = self.kv_cache_bytes(), self.tokens_in_flight()
            left = room.left(kv, self._prefix.nbytes)
        for i, work in enumerate(batch):
            try:
                x = self._input(work.payload)
                if room is not None:
                    left = room.take(left, x.shape[1], held, self._prefix, kv)
                state = self._state(work)
                ids = work.payload if isinstance(work.payload, list) else work.ids
                if state.tokens is not None and ids is not None and len(ids) == x.shape[1]:
                    state.tokens.extend(ids)
                else:
                    state.tokens = None
                ready.append((i, state, x))
            except Exception as exc:  # noqa: BLE001 - fails this request only
                results[i] = exc
        keys = [batch[i].request_id for i, _, _ in ready]
        self._batch_of.update(dict.fromkeys(keys, tuple(keys)))
        out = None
        if len(ready) > 1:  # one forward, in a decode group (None: caches that cannot merge)
            x = mx.concatenate([x for _, _, x in ready], axis=0)
            out = self._groups.forward(self.stage, keys, x, [state.cache for _, state, _ in ready], mergeable)
        else:
            self._groups.dissolve(keys)  # a step alone needs the request's own cache
        if out is not None:
            for row, (i, state, _) in enumerate(ready):
                results[i] = self._finish_one(state, out[row:row + 1], 1, False)
        elif len(ready) > 1 and hasattr(self.stage, "forward_many"):  # a tensor group batches in its ranks
            outs = self.stage.forward_many([x for _, _, x in ready], [state.cache for _, state, _ in ready])
            for (i, state, _), out in zip(ready, outs, strict=True):
                try:
                    results[i] = out if isinstance(out, Exception) else self._finish_one(state, out, 1, False)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    results[i] = exc
        else:
            for i, state, x in ready:
                try:
                    out = self.stage(x, state.cache, head=None if batch[i].drafts else not batch[i].more)
                    results[i] = self._finish_one(state, out, x.shape[1], batch[i].more, batch[i].drafts)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    log.exception("stage forward failed for request %s", batch[i].request_id)
                    results[i] = exc
        if batch[0].tokens == 1:
            self.last_batch = len(ready)
            self.batch_histogram[len(ready)] += 1
            self.recent_batches.append((time.monotonic(), len(ready)))
        return self._out_of_memory(results)

    def _out_of_memory(self, results: list[Any]) -> list[Any]:
        """A step whose allocation failed ends as :class:`~.kv_room.OutOfMemory` (the node is told)."""
        room = self.kv_room
        return [room.out_of_memory(r) if room is not None and isinstance(r, Exception) else r for r in results]

    def _release_many(self, releases: list[Work]) -> list[bool]:
        return [self.release(w.request_id, w.token_ids) for w in releases]

    def release(self, request_id: str, token_ids: list[int] | None = None) -> bool:
        """Drop a request's KV cache (worker thread), keeping it in the prefix store first
        when ``token_ids`` name its tokens. Returns whether it was held."""
        self._groups.dissolve([request_id])
        self._batch_of.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        speculation.settle_for_release(state, token_ids, self.boundaries)
        kept = bool(token_ids) and len(token_ids) >= state.offset > 0
        self.boundaries.end(state.boundary, state.scope, token_ids[:state.offset] if kept else None)
        if kept:
            try:
                self.prefix.insert(state.scope, token_ids[: state.offset], state.cache)
            except Exception:  # a store failure must not fail the release
                log.exception("prefix store: cannot keep request %s", request_id)
        return True

    def batch_stats(self, window_s: float = 10.0) -> dict:
        """Decode batching figures for ``/v1/cluster``: the limit, the last batch, the
        mean batch over the last ``window_s`` seconds, the histogram since start and
        the steps waiting."""
        return batch_figures(self.max_batch, self.last_batch, self.recent_batches, self.batch_histogram,
                             self.queued, window_s, time.monotonic(), self._groups.unmerged)

    def close(self) -> None:
        """Drop every cache and waiting step and stop the worker thread."""
        self._drop(lambda w: True, "the node is shutting down")
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        self._requests.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
