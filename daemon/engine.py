"""The sharded engine of one node: a stage, per-request KV caches, one MLX worker thread.

All MLX work (loading, forward passes, sampling, tensor encoding and decoding) runs
on a single worker thread, so the asyncio event loop never blocks on compute and
MLX state is touched by one thread only.

A request's KV cache lives here from its prefill (step 0) until it is released;
every forward checks that the sender's ``offset`` equals the number of tokens in the
cache, so a desynchronised ring fails the request instead of computing garbage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from . import codec
from .rpc import ringlet_pb2 as pb
from .sampling import RequestSampler, SamplingParams
from .stage import Stage

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request cannot proceed on this stage (unknown request, offset mismatch, ...)."""


@dataclass
class _RequestState:
    cache: list
    sampler: RequestSampler | None
    offset: int = 0
    last_used: float = field(default_factory=time.monotonic)


def sampling_from_pb(message: pb.Sampling | None) -> SamplingParams:
    """Sampling parameters from their wire form."""
    if message is None:
        return SamplingParams()
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed if message.has_seed else None,
        steps_done=message.steps_done,
    )


def sampling_to_pb(params: SamplingParams) -> pb.Sampling:
    """The wire form of sampling parameters."""
    return pb.Sampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        steps_done=params.steps_done,
    )


class StageEngine:
    """Runs one stage for many requests.

    Args:
        stage: the loaded stage (built on the worker thread via :meth:`create`).
        executor: the single-thread executor that owns MLX.
        max_tensor_bytes: the largest incoming hidden-states payload accepted, bytes.
    """

    def __init__(self, stage: Stage | None, executor: concurrent.futures.ThreadPoolExecutor,
                 max_tensor_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES):
        self.stage = stage
        self.executor = executor
        self.max_tensor_bytes = max_tensor_bytes
        self._requests: dict[str, _RequestState] = {}
        self.tokens_processed = 0
        self.busy_s = 0.0

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

    async def run(self, fn: Callable, *args: Any):
        """Run ``fn(*args)`` on the MLX worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # --- worker-thread functions ---------------------------------------------------------

    def swap(self, stage: Stage | None) -> None:
        """Serve ``stage`` from now on (worker thread): every KV cache of the previous
        stage is dropped (its requests resume on the new plan by re-prefilling)."""
        self.stage = stage
        self._requests.clear()
        mx.clear_cache()

    def _state(self, request_id: str, step: int, offset: int, sampling: SamplingParams | None) -> _RequestState:
        if self.stage is None:
            raise RequestError("this node holds no stage of the current plan")
        if step == 0:
            if offset != 0:
                raise RequestError(f"request {request_id}: prefill must start at offset 0, got {offset}")
            sampler = RequestSampler(sampling or SamplingParams()) if self.stage.last else None
            state = _RequestState(cache=self.stage.make_cache(), sampler=sampler)
            self._requests[request_id] = state
            return state
        state = self._requests.get(request_id)
        if state is None:
            raise RequestError(f"request {request_id}: no KV cache on this stage (not prefilled or released)")
        if state.offset != offset:
            raise RequestError(
                f"request {request_id}: offset {offset} does not match the {state.offset} tokens in its KV cache"
            )
        return state

    def step(self, request_id: str, step: int, offset: int, payload: list[int] | pb.Tensor,
             sampling: SamplingParams | None) -> pb.Tensor | int:
        """Run one forward of this stage for one request.

        Args:
            request_id: the request.
            step: 0 for the prefill (creates the KV cache), n for the n-th decode step.
            offset: tokens already in the request's KV cache (must match).
            payload: token ids on the first stage; a Tensor message with hidden states
                ``(1, tokens, hidden_size)`` on the others.
            sampling: the request's sampling parameters (used on step 0 of the last stage).

        Returns:
            The encoded hidden states for the next stage, or the sampled token id on
            the last stage.

        Raises:
            codec.TensorDecodeError: malformed hidden states.
            RequestError: unknown request or offset mismatch.
        """
        t0 = time.perf_counter()
        if isinstance(payload, list):
            x = mx.array([payload], dtype=mx.int32)
        else:
            x = codec.decode(payload, max_bytes=self.max_tensor_bytes, require_finite=True)
            if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.stage.hidden_size:
                raise codec.TensorDecodeError(
                    f"hidden states must have shape (1, tokens, {self.stage.hidden_size}), got {tuple(x.shape)}"
                )
        state = self._state(request_id, step, offset, sampling)
        out = self.stage(x, state.cache)
        state.offset += x.shape[1]
        state.last_used = time.monotonic()
        self.tokens_processed += x.shape[1]
        try:
            if self.stage.last:
                return state.sampler(out[0, -1])
            return codec.encode(out)
        finally:
            self.busy_s += time.perf_counter() - t0

    def release(self, request_id: str) -> bool:
        """Drop a request's KV cache. Returns whether it was held."""
        return self._requests.pop(request_id, None) is not None

    def close(self) -> None:
        """Drop every cache and stop the worker thread."""
        self._requests.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)
