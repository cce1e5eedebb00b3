"""The node: serves its stage of the committed plan, heads generations, talks gRPC.

Data path of one generation (plan with stages 0..n-1 in ring order)::

    API node --Generate--> stage 0 --Hop--> stage 1 --Hop--> ... stage n-1
                              ^                                   |
                              +------- Hop (sampled token) -------+

Stage 0 heads the generation: it embeds the prompt (prefill, step 0), and each
token the last stage samples comes back to it over the ring; it streams the token
to the API node and embeds it for the next decode step, until an end-of-sequence
token or ``max_tokens``. Then a release travels the ring and every stage drops the
request's KV cache. A stage failing a request sends the error forward; it reaches
stage 0, which ends that request with the error.

Plans change by epoch (see :mod:`ringlet.daemon.cluster.negotiation`): :meth:`Node.prepare`
loads the new stage in the background (reusing the layers it already holds) while
the old plan serves; :meth:`Node.commit` switches. The API node owns each request's
tokens so far: when the plan changes or a stage fails, it resumes the request on
the new plan by re-prefilling prompt + tokens so far, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc
import psutil

from ringlet.daemon.engine.defaults import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK
from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.engine.scheduler import (
    RequestDropped,
    RequestError,
    RequestRetry,
    StageEngine,
    sampling_from_pb,
    sampling_to_pb,
)
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.engine.stage import Stage, load_stage, token_id_error
from ringlet.daemon.errors import GenerationError, NoPlanError
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.hop import HopLink
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec
from ringlet.daemon.wire.transport import TransportConfig, make_channel, make_server

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Seconds a failed request waits for a new plan before its error is reported:
#: detection (2 s) + negotiation + loading, with room to spare.
RESUME_WAIT_S = 10.0
#: Prompt tokens per step timeout while waiting for the first token: a prefill may
#: take one ``step_timeout_s`` per this many tokens (MLX on a CPU core prefills about
#: 30 tokens/s per stage of a 135M model, so 64 tokens is ~2 s per stage of 30 s).
PREFILL_TIMEOUT_TOKENS = 64
#: Seconds between retries while stage 0 and this node hold different epochs.
EPOCH_SKEW_RETRY_S = 0.25


class _PlanChanged(GenerationError):
    """The committed plan changed under a request (it resumes on the new one)."""


class _EpochSkew(GenerationError):
    """Stage 0 has not committed the caller's epoch yet (or has a newer one): members
    commit a plan within moments of each other, so the request is simply retried."""


class _Retry(GenerationError):
    """A stage lost the request's KV cache while the plan stands (its tensor group
    restarted): the request resumes on the same plan (``Activation.retry``)."""


@dataclass
class NodeConfig:
    """Settings of one node.

    Attributes:
        host: address the gRPC server binds and peers use (``127.0.0.1`` for loopback).
        port: gRPC port.
        model: the resolved model.
        plan: a static plan (ring order), or ``None`` to take negotiated plans.
        dtype: ``None`` (model precision) or float16 / bfloat16 / float32.
        node_id: this node's id.
        transport: gRPC settings (message limit, keepalive, secret).
        step_timeout_s: seconds stage 0 waits for a token before failing the request
            (for the first token, this per ``PREFILL_TIMEOUT_TOKENS`` prompt tokens).
        plan_wait_s: seconds a request waits for a plan while the cluster forms.
        resume_attempts: how many times a request is resumed on a new plan.
        fetch: for a node without the model files, ``await fetch(start, end)`` pulls that
            stage's tensors from a member into the local sparse copy before loading.
        max_batch: the most decode steps a stage runs as one forward (1: no batching).
        prefill_chunk: prompt tokens per prefill chunk; stage 0 sends each chunk on
            as soon as it is computed, so stages prefill in a pipeline.
    """

    host: str
    port: int
    model: ModelLocation
    plan: list[StageSpec] | None = None
    dtype: str | None = None
    node_id: str = ""
    transport: TransportConfig = field(default_factory=TransportConfig)
    step_timeout_s: float = 30.0
    plan_wait_s: float = 30.0
    resume_attempts: int = 8
    fetch: Callable[[int, int], Awaitable[None]] | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    vocab_size: int | None = None
    context_tokens: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Generation:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    epoch: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    finished: bool = False


class Node:
    """One ringlet daemon's serving core (no HTTP; see :mod:`ringlet.daemon.api.app`).

    ``cluster`` (set by the runner in negotiated mode) handles membership and
    negotiation RPCs; see :class:`ringlet.daemon.cluster.negotiation.Negotiator`.
    """

    def __init__(self, config: NodeConfig):
        self.config = config
        self.node_id = config.node_id or config.address
        self.state = "starting"
        self.engine: StageEngine | None = None
        self.plan: ServingPlan | None = None
        self.index: int | None = None
        self.cluster = None
        self.tp = None  # tensor-parallel serving (tp_serving.TPServing) in negotiated mode
        self.cluster_id = ""
        self.incarnation = ""
        self._server: grpc.aio.Server | None = None
        self._next: HopLink | None = None
        self._generations: dict[str, _Generation] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prepared: dict[tuple[int, str], Stage | None] = {}
        self._plan_changed = asyncio.Event()
        self.hop_latency_s: deque[float] = deque(maxlen=512)
        self.memory: dict[str, int] = {}
        self.recent: deque[dict] = deque(maxlen=32)
        self.tokens_generated_total = 0
        self.requests_served = 0
        self.events: deque[dict] = deque(maxlen=100)
        self.loading_progress: float | None = None  # 0..1 while a stage loads
        self._tasks: set[asyncio.Task] = set()
        self._token_times: deque[float] = deque(maxlen=4096)  # monotonic time of each token headed here

    # --- plan views ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.plan.epoch if self.plan else 0

    @property
    def stage_spec(self) -> StageSpec | None:
        return self.plan.stages[self.index] if self.plan and self.index is not None else None

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.plan is not None and self.index == len(self.plan.stages) - 1

    def event(self, kind: str, message: str) -> None:
        """Append to the event log shown by ``/v1/cluster`` and the dashboard."""
        self.events.append({"ts": time.time(), "kind": kind, "message": message})

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, serve_grpc: bool = True) -> None:
        """Start the gRPC server and the MLX worker; with a static plan, load and serve it."""
        self.state = "starting"
        if serve_grpc:
            self._server = make_server(self.config.transport, self.config.address)
            pb_grpc.add_RingServicer_to_server(_RingServicer(self), self._server)
            await self._server.start()
        executor = StageEngine.new_executor()
        # An empty daemon: server up, MLX worker started, no weights. Its RSS is the
        # baseline the memory figures in info() are read against.
        await asyncio.get_running_loop().run_in_executor(executor, _warm_up_mlx)
        self.memory["rss_before_load_bytes"] = psutil.Process().memory_info().rss
        self.engine = StageEngine(None, executor, max_tensor_bytes=self.config.transport.max_message_bytes,
                                  max_batch=self.config.max_batch)
        if self.config.plan is not None:
            stages = tuple(self.config.plan)
            digest = ",".join(f"{s.address}={s.start}:{s.end}" for s in stages)
            plan = ServingPlan(epoch=1, stages=stages, plan_id=f"static:{digest}")
            await self.prepare(plan)
            await self.commit(plan)
        else:
            self.state = "discovering"

    async def stop(self) -> None:
        """Stop serving: fail open generations, close streams and the server."""
        for gen in list(self._generations.values()):
            self._finish(gen, GenerationError("the node is shutting down"))
        if self._next is not None:
            await self._next.close()
        for ch in self._channels.values():
            await ch.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self.engine is not None:
            self.engine.close()
        self.state = "stopped"

    # --- plans: prepare, commit ----------------------------------------------------------

    async def prepare(self, plan: ServingPlan) -> int:
        """Load this node's stage of ``plan`` while the current plan keeps serving.

        Layers this node already holds are reused; only the others are read.
        Returns the bytes read from disk.

        Raises:
            ModelFormatError / PlanError / OSError: the stage cannot be loaded.
        """
        key = (plan.epoch, plan.plan_id)
        index = plan.index_of(self.node_id, self.config.address)
        if plan.infeasible or index is None or plan.is_tensor:  # tensor: the rank processes load
            self._prepared[key] = None
            return 0
        if plan.is_hybrid:  # the group's rank processes load, once the plan is committed
            self._prepared[key] = self.tp.group_stage(plan, index)
            return 0
        spec = plan.stages[index]
        current = self.engine.stage if isinstance(self.engine.stage, Stage) else None
        if current is not None and (current.start, current.end) == (spec.start, spec.end):
            self._prepared[key] = current
            return 0
        self.state = "loading" if current is None else self.state
        t0 = time.perf_counter()
        if self.config.fetch is not None:
            self.state = "fetching" if current is None else self.state
            await self.config.fetch(spec.start, spec.end)

        def progress(done: int, total: int) -> None:  # worker thread; a float store is atomic
            self.loading_progress = done / total if total else 1.0

        self.loading_progress = 0.0
        try:
            stage = await self.engine.run(lambda: load_stage(self.config.model, spec.start, spec.end,
                                                             self.config.dtype, reuse=current, progress=progress))
        finally:
            self.loading_progress = None
        loaded = stage.loaded_bytes()
        self._prepared[key] = stage
        log.info("prepared epoch %d: layers [%d, %d), read %.1f MB of %.1f MB in %.2f s", plan.epoch,
                 spec.start, spec.end, loaded / 1e6, stage.nbytes() / 1e6, time.perf_counter() - t0)
        if "stage_param_bytes" not in self.memory:
            self.memory["stage_param_bytes"] = stage.nbytes()
            self.memory["mlx_active_after_load_bytes"] = await self.engine.run(_mlx_active_bytes)
            self.memory["peak_rss_after_load_bytes"] = _peak_rss_bytes()
        return loaded

    async def commit(self, plan: ServingPlan) -> None:
        """Switch to ``plan`` (prepared before). In-flight requests of the old plan
        are ended here with a plan-changed error; their API nodes resume them.

        Raises:
            KeyError: ``plan`` was never prepared.
        """
        key = (plan.epoch, plan.plan_id)
        stage = self._prepared.pop(key)
        for old in [k for k in self._prepared if k[0] <= plan.epoch]:
            self._prepared.pop(old, None)
        old_index_spec = self.stage_spec
        await self.engine.swap_stage(stage)
        self.plan = plan
        self.index = plan.index_of(self.node_id, self.config.address)
        for gen in list(self._generations.values()):
            self._finish(gen, _PlanChanged(f"the plan changed to epoch {plan.epoch}"))
        successor = None
        if self.index is not None and len(plan.stages) > 1:
            successor = plan.stages[(self.index + 1) % len(plan.stages)].address
        if self._next is not None and (successor is None or self._next.address != successor):
            await self._next.close()
            self._next = None
        if successor is not None and self._next is None:
            self._next = HopLink(successor, self.config.transport)
        if plan.infeasible:
            self.state = "unplanned"
        elif self.index is None:
            in_group = plan.is_hybrid and any(self.node_id in g for g in plan.tp.get("groups", ()))
            self.state = "ready" if in_group else "standby"  # a hybrid group's member runs a rank
        else:
            self.state = "ready"
        spec = self.stage_spec
        where = f"layers [{spec.start}, {spec.end})" if spec else "no stage"
        log.info("committed epoch %d: %s%s", plan.epoch, where,
                 f" (was [{old_index_spec.start}, {old_index_spec.end}))" if old_index_spec else "")
        changed, self._plan_changed = self._plan_changed, asyncio.Event()
        changed.set()

    # --- generation (public, any node) ---------------------------------------------------

    async def _wait_plan(self, newer_than: int = 0, timeout_s: float | None = None) -> ServingPlan:
        """The committed plan with epoch > ``newer_than`` (waits for one while the cluster
        forms or re-plans).

        Raises:
            NoPlanError: the committed plan cannot serve the model, or none came in time.
        """
        deadline = time.monotonic() + (self.config.plan_wait_s if timeout_s is None else timeout_s)
        while True:
            plan = self.plan
            if plan is not None and plan.epoch > newer_than:
                if plan.infeasible:
                    raise NoPlanError(plan.infeasible)
                return plan
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if plan is not None and plan.infeasible:
                    raise NoPlanError(plan.infeasible)
                raise NoPlanError("the cluster has no serving plan yet (still forming or re-planning)")
            waiter = self._plan_changed
            try:
                await asyncio.wait_for(waiter.wait(), timeout=remaining)
            except TimeoutError:
                pass

    async def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int] | set[int], request_id: str | None = None,
                       ) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens after ``prompt``; yields token ids as they come.

        Stops after a token in ``stop_ids`` (that token is yielded). Works on any node:
        the request runs on the committed plan's stage 0 (here or over gRPC). If the
        plan changes or a stage fails mid-stream, the request resumes on the next
        plan by re-prefilling prompt + tokens so far; the caller sees one stream.

        Raises:
            NoPlanError: no plan can serve the model (the message says why).
            GenerationError: the request failed and could not be resumed.
        """
        request_id = request_id or uuid.uuid4().hex
        if (why := self.prompt_error(prompt, max_tokens)) is not None:
            raise GenerationError(why)
        produced: list[int] = []
        stop_ids = frozenset(stop_ids)
        failed_epoch = 0
        attempts = skews = 0
        while len(produced) < max_tokens:
            plan = await self._wait_plan(newer_than=failed_epoch if attempts else 0)
            resumed = replace(sampling, steps_done=sampling.steps_done + len(produced))
            try:
                async for token in self._attempt(plan, request_id, prompt + produced, max_tokens - len(produced),
                                                 resumed, stop_ids):
                    produced.append(token)
                    yield token
                    if token in stop_ids:
                        return
                return
            except NoPlanError:
                raise
            except GenerationError as exc:
                skewed = isinstance(exc, _EpochSkew)
                skews += skewed
                attempts += not skewed
                if attempts > self.config.resume_attempts or skews * EPOCH_SKEW_RETRY_S > RESUME_WAIT_S:
                    raise
                log.info("request %s: %s; resuming after %d tokens", request_id, exc, len(produced))
                self.event("resume", f"request {request_id[:8]} resumes after {len(produced)} tokens: {exc}")
                if skewed:
                    await asyncio.sleep(EPOCH_SKEW_RETRY_S)  # stage 0 commits the same plan momentarily
                elif isinstance(exc, _Retry):
                    pass  # the plan stands and its stage recovered: prefill again on it
                elif self.plan is not None and self.plan.epoch == plan.epoch:
                    # A stage failure is followed by a re-plan within seconds (heartbeats,
                    # then negotiation). If none comes, the failure is not the cluster's
                    # shape but the request itself: report it instead of retrying it.
                    try:
                        await self._wait_plan(newer_than=plan.epoch,
                                              timeout_s=min(self.config.step_timeout_s, RESUME_WAIT_S))
                    except NoPlanError:
                        if self.plan is not None and self.plan.infeasible:
                            raise
                        raise exc from None
                failed_epoch = 0
                request_id = f"{request_id.split('~')[0]}~{attempts + skews}"

    def prompt_error(self, prompt: list[int], max_tokens: int) -> str | None:
        """Why a request cannot run on this model (``None`` = it can): an empty prompt, a
        token id outside the vocabulary (it would index past the embedding table), a
        prompt that fills the context, or a negative ``max_tokens``."""
        if not prompt:
            return "the prompt is empty"
        if (error := token_id_error(prompt, self.config.vocab_size)) is not None:
            return f"prompt {error}"
        context = self.config.context_tokens
        if context and len(prompt) >= context:
            return f"the prompt has {len(prompt)} tokens; the model's context is {context}"
        if max_tokens < 0:
            return f"max_tokens must not be negative, got {max_tokens}"
        return None

    async def _attempt(self, plan: ServingPlan, request_id: str, prompt: list[int], max_tokens: int,
                       sampling: SamplingParams, stop_ids: frozenset[int]) -> AsyncIterator[int]:
        """One try of a generation on ``plan``; raises :class:`_PlanChanged` as soon as
        this node commits another plan."""
        changed = self._plan_changed
        if plan is not self.plan:
            raise _PlanChanged("the plan changed before the request started")
        head = plan.stages[0]
        if plan.index_of(self.node_id, self.config.address) == 0:
            source = self._head_source(request_id, prompt, max_tokens, sampling, stop_ids)
        else:
            source = self._generate_remote(head.address, plan.epoch, request_id, prompt, max_tokens, sampling,
                                           stop_ids)
        it = source.__aiter__()
        change = asyncio.ensure_future(changed.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt, change}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    raise _PlanChanged(f"the plan changed to epoch {self.epoch}")
                try:
                    token = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield token
        finally:
            change.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()  # let the generator unwind before it is closed
                with contextlib.suppress(BaseException):
                    await nxt
            await it.aclose()

    async def _generate_remote(self, address: str, epoch: int, request_id: str, prompt: list[int],
                               max_tokens: int, sampling: SamplingParams, stop_ids: frozenset[int],
                               ) -> AsyncIterator[int]:
        stub = pb_grpc.RingStub(self._channel(address))
        call = stub.Generate(pb.GenerateRequest(
            request_id=request_id, prompt=prompt, max_tokens=max_tokens, epoch=epoch,
            sampling=sampling_to_pb(sampling), stop_ids=sorted(stop_ids)))
        try:
            async for event in call:
                if event.WhichOneof("event") == "error":
                    raise (_Retry if event.retry else GenerationError)(event.error)
                yield event.token
        except grpc.aio.AioRpcError as exc:
            error = _EpochSkew if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else GenerationError
            raise error(f"stage 0 ({address}): {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = make_channel(self.config.transport, address)
            self._channels[address] = ch
        return ch

    def _head_source(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                     stop_ids: frozenset[int]) -> AsyncIterator[int]:
        """This node heads the request: stage 0 of a pipeline, or rank 0 of a tensor group."""
        if self.plan is not None and self.plan.is_tensor and self.tp is not None:
            return self.tp.generate(request_id, prompt, max_tokens, sampling, stop_ids)
        return self._generate_local(request_id, prompt, max_tokens, sampling, stop_ids)

    # --- stage 0: heading a generation --------------------------------------------------

    async def _generate_local(self, request_id: str, prompt: list[int], max_tokens: int,
                              sampling: SamplingParams, stop_ids: frozenset[int]) -> AsyncIterator[int]:
        if not self.is_head:
            raise GenerationError("this node does not hold stage 0 of the current plan")
        if request_id in self._generations:
            raise GenerationError(f"request id {request_id} is already in flight")
        gen = _Generation(request_id, list(prompt), max_tokens, sampling, stop_ids, epoch=self.epoch)
        self._generations[request_id] = gen
        self.state = "serving"
        try:
            if max_tokens <= 0:
                return
            await self._advance(gen, step=0, payload=list(prompt))
            while True:
                # the first token follows the whole prefill: one step's allowance per
                # PREFILL_TIMEOUT_TOKENS prompt tokens
                timeout = self.config.step_timeout_s * (1 if gen.tokens else -(-len(prompt) // PREFILL_TIMEOUT_TOKENS))
                try:
                    item = await asyncio.wait_for(gen.queue.get(), timeout=timeout)
                except TimeoutError:
                    raise GenerationError(f"no token within {timeout:.0f} s; a stage may be down") from None
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not gen.finished:
                gen.finished = True
                await self._release(request_id)
            self._generations.pop(request_id, None)
            elapsed = time.perf_counter() - gen.started
            self.requests_served += 1
            self.recent.append({
                "request_id": request_id, "prompt_tokens": len(prompt), "completion_tokens": len(gen.tokens),
                "ttft_s": gen.ttft_s, "tokens_per_s": (len(gen.tokens) - 1) / (elapsed - gen.ttft_s)
                if gen.ttft_s is not None and len(gen.tokens) > 1 and elapsed > gen.ttft_s else None,
            })
            if not self._generations and self.state == "serving":
                self.state = "ready"

    async def _advance(self, gen: _Generation, step: int, payload: list[int]) -> None:
        """Run stage 0 for ``payload`` and pass the result on (or take the token, on a
        single-stage plan). A prompt longer than ``prefill_chunk`` goes in chunks, each
        sent on as soon as it is computed (the next stage starts on it meanwhile)."""
        if step == 0:
            chunk = max(1, self.config.prefill_chunk)
            pieces = [(off, payload[off:off + chunk]) for off in range(0, len(payload), chunk)]
        else:
            pieces = [(len(gen.prompt) + len(gen.tokens) - 1, payload)]
        for k, (offset, piece) in enumerate(pieces):
            more = k < len(pieces) - 1
            try:
                out = await self.engine.submit(gen.request_id, step, offset, piece, gen.sampling, more=more)
            except Exception as exc:  # fail this request only
                if not isinstance(exc, (RequestError, codec.TensorDecodeError)):
                    log.exception("stage 0 failed request %s", gen.request_id)
                self._finish(gen, (_Retry if isinstance(exc, RequestRetry) else GenerationError)(f"stage 0: {exc}"))
                return
            if gen.finished:
                return
            if out is None:  # a single-stage plan filling its cache chunk by chunk
                continue
            if isinstance(out, int):
                self._on_token(gen, out)
                return
            message = pb.Activation(request_id=gen.request_id, epoch=gen.epoch, step=step, offset=offset,
                                    hidden=out, stage=1, sent_at=time.time(), more=more)
            if step == 0 and offset == 0:
                message.sampling.CopyFrom(sampling_to_pb(gen.sampling))
            try:
                await self._next.send(message)
            except (ConnectionError, AttributeError) as exc:
                self._finish(gen, GenerationError(f"next stage unreachable: {exc}"))
                return

    def _on_token(self, gen: _Generation, token: int) -> None:
        if gen.finished:
            return
        if gen.ttft_s is None:
            gen.ttft_s = time.perf_counter() - gen.started
        gen.tokens.append(token)
        self.tokens_generated_total += 1
        self._token_times.append(time.monotonic())
        gen.queue.put_nowait(token)
        if token in gen.stop_ids or len(gen.tokens) >= gen.max_tokens:
            self._finish(gen, None)
            return
        asyncio.ensure_future(self._advance(gen, step=len(gen.tokens), payload=[token]))

    def _finish(self, gen: _Generation, error: Exception | None) -> None:
        if gen.finished:
            return
        gen.finished = True
        gen.queue.put_nowait(error)
        asyncio.ensure_future(self._release(gen.request_id))

    async def _release(self, request_id: str) -> None:
        """Drop the request's cache here and send a release around the ring."""
        if self.engine is not None:
            await self.engine.submit_release(request_id)
        if self._next is not None and self.is_head:
            try:
                await self._next.send(pb.Activation(request_id=request_id, epoch=self.epoch, release=True))
            except ConnectionError as exc:
                log.debug("could not send release of %s: %s", request_id, exc)

    # --- any stage: incoming activations ------------------------------------------------

    async def on_activation(self, message: pb.Activation) -> None:
        """Handle one activation from the previous stage.

        Returns as soon as the step is queued on the engine (the result is sent on
        by a task), so the hop stream keeps reading and the steps of concurrent
        requests can meet in one batch.

        Raises:
            codec.TensorDecodeError: malformed hidden states (after the error has been
                sent on towards stage 0 for that request).
        """
        if message.sent_at:
            self.hop_latency_s.append(max(0.0, time.time() - message.sent_at))
        if message.WhichOneof("payload") == "hidden":
            codec.check(message.hidden, max_bytes=self.config.transport.max_message_bytes)
        rid = message.request_id
        if self.is_head:
            gen = self._generations.get(rid)
            if gen is None or message.epoch != gen.epoch:
                return  # a late token or error for a finished request or an old plan
            if message.error:
                self._finish(gen, (_Retry if message.retry else GenerationError)(message.error))
            elif message.WhichOneof("payload") == "token":
                self._on_token(gen, message.token)
            return
        if self.index is None or message.epoch != self.epoch:
            if message.WhichOneof("payload") == "hidden" and not message.release:
                await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                                  error=f"stage at {self.config.address} serves epoch "
                                                        f"{self.epoch}, not {message.epoch}"))
            return
        if message.release:
            self._spawn(self._release_and_forward(message))
            return
        if message.error:
            await self._forward(message)
            return
        if message.WhichOneof("payload") != "hidden":
            raise codec.TensorDecodeError("activation carries no hidden states")
        if (error := self.engine.shape_error(tuple(message.hidden.shape))) is not None:
            await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                              error=f"stage {self.index} ({self.config.address}): {error}"))
            raise codec.TensorDecodeError(error)
        sampling = sampling_from_pb(message.sampling) if message.HasField("sampling") else None
        future = self.engine.submit(rid, message.step, message.offset, message.hidden, sampling, more=message.more)
        self._spawn(self._complete(message, future))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _complete(self, message: pb.Activation, future: asyncio.Future) -> None:
        """Send on the result of one queued step (hidden states, or the sampled token
        from the last stage), or the error that failed the request."""
        rid = message.request_id
        try:
            out = await future
        except RequestDropped:
            return  # released or re-planned while it waited: nobody wants the result
        except Exception as exc:  # any failure fails this request only; the node keeps serving
            if not isinstance(exc, (RequestError, codec.TensorDecodeError)):
                log.error("stage %s failed request %s: %s", self.index, rid, exc)
            await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                              error=f"stage {self.index} ({self.config.address}): {exc}",
                                              retry=isinstance(exc, RequestRetry)))
            return
        if out is None:
            return  # the last stage took a prefill chunk that more chunks follow
        nxt = pb.Activation(request_id=rid, epoch=message.epoch, step=message.step, offset=message.offset,
                            stage=(self.index + 1) % len(self.plan.stages), sent_at=time.time(), more=message.more)
        if isinstance(out, int):
            nxt.token = out
        else:
            nxt.hidden.CopyFrom(out)
            if message.HasField("sampling"):
                nxt.sampling.CopyFrom(message.sampling)
        await self._forward(nxt)

    async def _release_and_forward(self, message: pb.Activation) -> None:
        await self.engine.submit_release(message.request_id)
        if not self.is_last:
            await self._forward(message)

    async def _forward(self, message: pb.Activation) -> None:
        if self._next is None:
            return
        try:
            await self._next.send(message)
        except ConnectionError as exc:
            log.warning("request %s: %s", message.request_id, exc)

    # --- introspection -------------------------------------------------------------------

    def plan_json(self) -> str:
        """The committed plan as JSON (for peers' handshakes)."""
        if self.plan is None:
            return ""
        return json.dumps({"epoch": self.plan.epoch, "plan_id": self.plan.plan_id,
                           "infeasible": self.plan.infeasible,
                           "stages": [s.__dict__ for s in self.plan.stages]})

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Aggregate tokens/s of the requests this node heads (stage 0): tokens in the
        last ``window_s`` seconds / ``window_s``, all requests together."""
        now = time.monotonic()
        return sum(1 for t in self._token_times if now - t <= window_s) / window_s

    def info(self) -> dict:
        """A JSON-safe summary of this node: stage, plan, state and live figures."""
        lat = list(self.hop_latency_s)
        spec = self.stage_spec
        stage = self.engine.stage if self.engine else None
        info = {
            "node_id": self.node_id,
            "address": self.config.address,
            "state": self.state,
            "epoch": self.epoch,
            "plan_id": self.plan.plan_id if self.plan else None,
            "infeasible": self.plan.infeasible if self.plan else None,
            "model": self.config.model.name,
            "num_layers": stage.num_layers if stage else None,
            "stage": self.index,
            "layer_range": [spec.start, spec.end] if spec else None,
            "plan": [{"node_id": s.node_id, "address": s.address, "start": s.start, "end": s.end}
                     for s in (self.plan.stages if self.plan else ())],
            "plan_detail": self.plan.detail if self.plan else None,
            "requests_in_flight": len(self._generations),
            "kv_caches": self.engine.active_requests if self.engine else [],
            "batching": {**self.engine.batch_stats(), "prefill_chunk": self.config.prefill_chunk,
                         "head_tokens_per_s": self.tokens_per_s()} if self.engine else None,
            "hop_latency_median_s": statistics.median(lat) if lat else None,
            "tokens_generated_total": self.tokens_generated_total,
            "loading_progress": self.loading_progress,
            "requests_served": self.requests_served,
            "memory": {**self.memory, "rss_bytes": psutil.Process().memory_info().rss,
                       "peak_rss_bytes": _peak_rss_bytes(),
                       "stage_bytes": stage.nbytes() if stage else 0},
            "recent_requests": list(self.recent),
            "events": list(self.events),
        }
        if self.cluster is not None:
            info.update(self.cluster.info())
        return info


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _warm_up_mlx() -> None:
    """First MLX use on the worker thread (stream and allocator set-up)."""
    import mlx.core as mx
    import mlx_lm.models.cache  # noqa: F401 - imported by every stage

    mx.eval(mx.zeros((8, 8)) @ mx.zeros((8, 8)))


def _mlx_active_bytes() -> int:
    import mlx.core as mx

    mx.clear_cache()
    return int(mx.get_active_memory())


class _RingServicer(pb_grpc.RingServicer):
    """gRPC face of a :class:`Node`."""

    def __init__(self, node: Node):
        self.node = node

    async def Hop(self, request_iterator, context):  # noqa: N802 - gRPC method name
        received = 0
        async for message in request_iterator:
            received += 1
            try:
                await self.node.on_activation(message)
            except codec.TensorDecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {exc}")
        yield pb.HopAck(received=received)

    async def Generate(self, request, context):  # noqa: N802
        node = self.node
        if not node.is_head:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node does not hold stage 0")
        if request.epoch and request.epoch != node.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this node serves epoch {node.epoch}, not {request.epoch}")
        if (why := node.prompt_error(list(request.prompt), request.max_tokens)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            async for token in node._head_source(request.request_id or uuid.uuid4().hex, list(request.prompt),
                                                 request.max_tokens, sampling_from_pb(request.sampling),
                                                 frozenset(request.stop_ids)):
                yield pb.GenerateEvent(token=token)
        except GenerationError as exc:
            yield pb.GenerateEvent(error=str(exc), retry=isinstance(exc, _Retry))

    async def GetNodeInfo(self, request, context):  # noqa: N802
        node = self.node
        cluster = node.cluster
        if cluster is not None and request.caller_address:
            cluster.membership.consider(request.caller_address, request.caller_id or None)
        stage = node.engine.stage if node.engine else None
        return pb.NodeInfo(
            node_id=node.node_id, protocol_version=PROTOCOL_VERSION, cluster_id=node.cluster_id,
            grpc_port=node.config.port, model=node.config.model.name,
            num_layers=stage.num_layers if stage else 0,
            plan=[pb.LayerRange(node_id=s.node_id, start=s.start, end=s.end, grpc_address=s.address)
                  for s in (node.plan.stages if node.plan else ())],
            epoch=node.epoch, state=node.state, incarnation=node.incarnation,
            record_json=json.dumps(cluster.membership.own_record) if cluster else "",
            record_version=cluster.membership.record_version if cluster else 0,
            plan_json=node.plan_json(),
        )

    async def Echo(self, request, context):  # noqa: N802
        if request.echo:
            return pb.Ping(payload=request.payload, sent_at=request.sent_at)
        return pb.Ping(sent_at=request.sent_at)

    async def ShardManifest(self, request, context):  # noqa: N802
        from ringlet.daemon.shards import transfer as shard_transfer

        return await shard_transfer.serve_manifest(request, context, self.node.config.model)

    async def FetchShard(self, request, context):  # noqa: N802
        from ringlet.daemon.shards import transfer as shard_transfer

        async for chunk in shard_transfer.serve_fetch(request, context, self.node.config.model):
            yield chunk

    async def Beat(self, request, context):  # noqa: N802
        if self.node.cluster is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node runs a static plan")
        return self.node.cluster.membership.on_beat(request)

    async def Propose(self, request, context):  # noqa: N802
        if self.node.cluster is None:
            return pb.Vote(ok=False, reason="this node runs a static plan", node_id=self.node.node_id)
        return await self.node.cluster.on_propose(request)

    async def Commit(self, request, context):  # noqa: N802
        if self.node.cluster is None:
            return pb.Vote(ok=False, reason="this node runs a static plan", node_id=self.node.node_id)
        return await self.node.cluster.on_commit(request)

    async def RunRank(self, request, context):  # noqa: N802
        if self.node.tp is None:
            yield pb.RankEvent(error="this node runs no tensor-parallel serving (static plan)")
            return
        async for event in self.node.tp.run_rank(request, context):
            yield event
