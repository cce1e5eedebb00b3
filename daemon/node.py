"""The node: serves one stage of the plan, drives generations it heads, and talks gRPC.

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
"""

from __future__ import annotations

import asyncio
import logging
import resource
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import psutil

from . import codec
from .engine import RequestError, StageEngine, sampling_from_pb, sampling_to_pb
from .hop import HopLink
from .rpc import ringlet_pb2 as pb
from .rpc import ringlet_pb2_grpc as pb_grpc
from .sampling import SamplingParams
from .sources import ModelLocation
from .stage import load_stage
from .static_plan import StageSpec
from .transport import TransportConfig, make_channel, make_server

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


class GenerationError(Exception):
    """A generation failed on some stage; the message says where and why."""


@dataclass
class NodeConfig:
    """Settings of one node.

    Attributes:
        host: address the gRPC server binds and peers use (``127.0.0.1`` for loopback).
        port: gRPC port.
        model: the resolved model.
        dtype: ``None`` (model precision) or float16 / bfloat16 / float32.
        plan: stages in ring order; this node is the stage whose address is ``host:port``.
        transport: gRPC settings (message limit, keepalive, secret).
        step_timeout_s: seconds stage 0 waits for a token before failing the request.
    """

    host: str
    port: int
    model: ModelLocation
    plan: list[StageSpec]
    dtype: str | None = None
    node_id: str = ""
    transport: TransportConfig = field(default_factory=TransportConfig)
    step_timeout_s: float = 60.0

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
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    finished: bool = False


class Node:
    """One ringlet daemon's serving core (no HTTP; see :mod:`ringlet.daemon.api`)."""

    def __init__(self, config: NodeConfig):
        self.config = config
        self.node_id = config.node_id or config.address
        self.epoch = 1
        self.state = "starting"
        self.engine: StageEngine | None = None
        self.index = self._own_index()
        self._server: grpc.aio.Server | None = None
        self._next: HopLink | None = None
        self._generations: dict[str, _Generation] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.hop_latency_s: deque[float] = deque(maxlen=512)
        self.memory: dict[str, int] = {}
        self.recent: deque[dict] = deque(maxlen=32)

    def _own_index(self) -> int:
        for i, s in enumerate(self.config.plan):
            if s.address == self.config.address:
                return i
        raise ValueError(f"this node ({self.config.address}) is not a stage of the plan")

    @property
    def stage_spec(self) -> StageSpec:
        return self.config.plan[self.index]

    @property
    def head_address(self) -> str:
        return self.config.plan[0].address

    @property
    def is_head(self) -> bool:
        return self.index == 0

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, serve_grpc: bool = True) -> None:
        """Load this node's stage and start the gRPC server."""
        spec = self.stage_spec
        self.state = "loading"
        if serve_grpc:
            self._server = make_server(self.config.transport, self.config.address)
            pb_grpc.add_RingServicer_to_server(_RingServicer(self), self._server)
            await self._server.start()
        executor = StageEngine.new_executor()
        # An empty daemon: server up, MLX worker started, no weights. Its RSS is the
        # baseline the memory figures in info() are read against.
        await asyncio.get_running_loop().run_in_executor(executor, _warm_up_mlx)
        self.memory["rss_before_load_bytes"] = psutil.Process().memory_info().rss
        self.engine = await StageEngine.create(
            lambda: load_stage(self.config.model, spec.start, spec.end, self.config.dtype),
            executor=executor, max_tensor_bytes=self.config.transport.max_message_bytes,
        )
        self.memory["stage_param_bytes"] = self.engine.stage.nbytes()
        self.memory["mlx_active_after_load_bytes"] = await self.engine.run(_mlx_active_bytes)
        self.memory["peak_rss_after_load_bytes"] = _peak_rss_bytes()
        if len(self.config.plan) > 1:
            successor = self.config.plan[(self.index + 1) % len(self.config.plan)]
            self._next = HopLink(successor.address, self.config.transport)
        self.state = "ready"
        log.info("stage %d [%d, %d) ready on %s", self.index, spec.start, spec.end, self.config.address)

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

    # --- generation (public) ----------------------------------------------------------

    async def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int] | set[int], request_id: str | None = None,
                       ) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens after ``prompt``; yields token ids as they come.

        Stops after a token in ``stop_ids`` (that token is yielded). Works on any node:
        a node that is not stage 0 forwards the request to stage 0 over gRPC.

        Raises:
            GenerationError: a stage failed, or no token came within ``step_timeout_s``.
        """
        request_id = request_id or uuid.uuid4().hex
        if not prompt:
            raise GenerationError("the prompt is empty")
        if self.is_head:
            async for token in self._generate_local(request_id, prompt, max_tokens, sampling, frozenset(stop_ids)):
                yield token
            return
        stub = pb_grpc.RingStub(self._channel(self.head_address))
        call = stub.Generate(pb.GenerateRequest(
            request_id=request_id, prompt=prompt, max_tokens=max_tokens,
            sampling=sampling_to_pb(sampling), stop_ids=sorted(stop_ids)))
        try:
            async for event in call:
                if event.WhichOneof("event") == "error":
                    raise GenerationError(event.error)
                yield event.token
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(f"stage 0 ({self.head_address}) failed: {exc.details()}") from None
        finally:
            call.cancel()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = make_channel(self.config.transport, address)
            self._channels[address] = ch
        return ch

    # --- stage 0: heading a generation --------------------------------------------------

    async def _generate_local(self, request_id: str, prompt: list[int], max_tokens: int,
                              sampling: SamplingParams, stop_ids: frozenset[int]) -> AsyncIterator[int]:
        if request_id in self._generations:
            raise GenerationError(f"request id {request_id} is already in flight")
        gen = _Generation(request_id, list(prompt), max_tokens, sampling, stop_ids)
        self._generations[request_id] = gen
        self.state = "serving"
        try:
            if max_tokens <= 0:
                return
            await self._advance(gen, step=0, payload=list(prompt))
            while True:
                try:
                    item = await asyncio.wait_for(gen.queue.get(), timeout=self.config.step_timeout_s)
                except TimeoutError:
                    raise GenerationError(
                        f"no token within {self.config.step_timeout_s:.0f} s; a stage may be down"
                    ) from None
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
            self.recent.append({
                "request_id": request_id, "prompt_tokens": len(prompt), "completion_tokens": len(gen.tokens),
                "ttft_s": gen.ttft_s, "tokens_per_s": (len(gen.tokens) - 1) / (elapsed - gen.ttft_s)
                if gen.ttft_s is not None and len(gen.tokens) > 1 and elapsed > gen.ttft_s else None,
            })
            if not self._generations:
                self.state = "ready"

    async def _advance(self, gen: _Generation, step: int, payload: list[int]) -> None:
        """Run stage 0 for ``payload`` and pass the result on (or take the token, on a
        single-stage plan)."""
        offset = 0 if step == 0 else len(gen.prompt) + len(gen.tokens) - 1
        try:
            out = await self.engine.run(self.engine.step, gen.request_id, step, offset, payload, gen.sampling)
        except Exception as exc:  # fail this request only
            if not isinstance(exc, (RequestError, codec.TensorDecodeError)):
                log.exception("stage 0 failed request %s", gen.request_id)
            self._finish(gen, GenerationError(f"stage 0: {exc}"))
            return
        if isinstance(out, int):
            self._on_token(gen, out)
            return
        message = pb.Activation(request_id=gen.request_id, epoch=self.epoch, step=step, offset=offset,
                                hidden=out, stage=1, sent_at=time.time())
        if step == 0:
            message.sampling.CopyFrom(sampling_to_pb(gen.sampling))
        try:
            await self._next.send(message)
        except ConnectionError as exc:
            self._finish(gen, GenerationError(str(exc)))

    def _on_token(self, gen: _Generation, token: int) -> None:
        if gen.finished:
            return
        if gen.ttft_s is None:
            gen.ttft_s = time.perf_counter() - gen.started
        gen.tokens.append(token)
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
            await self.engine.run(self.engine.release, request_id)
        if self._next is not None and self.is_head:
            try:
                await self._next.send(pb.Activation(request_id=request_id, epoch=self.epoch, release=True))
            except ConnectionError as exc:
                log.warning("could not send release of %s: %s", request_id, exc)

    # --- any stage: incoming activations ------------------------------------------------

    async def on_activation(self, message: pb.Activation) -> None:
        """Handle one activation from the previous stage.

        Raises:
            codec.TensorDecodeError: malformed hidden states (after the error has been
                sent on towards stage 0 for that request).
        """
        if message.sent_at:
            self.hop_latency_s.append(max(0.0, time.time() - message.sent_at))
        rid = message.request_id
        if self.is_head:
            gen = self._generations.get(rid)
            if gen is None:
                return  # a late token or release for a finished request
            if message.error:
                self._finish(gen, GenerationError(message.error))
            elif message.WhichOneof("payload") == "token":
                self._on_token(gen, message.token)
            return
        if message.release:
            await self.engine.run(self.engine.release, rid)
            if self.index != len(self.config.plan) - 1:
                await self._forward(message)
            return
        if message.error:
            await self._forward(message)
            return
        sampling = sampling_from_pb(message.sampling) if message.HasField("sampling") else None
        payload = message.hidden if message.WhichOneof("payload") == "hidden" else None
        if payload is None:
            raise codec.TensorDecodeError("activation carries no hidden states")
        try:
            out = await self.engine.run(self.engine.step, rid, message.step, message.offset, payload, sampling)
        except Exception as exc:  # any failure fails this request only; the node keeps serving
            if not isinstance(exc, (RequestError, codec.TensorDecodeError)):
                log.exception("stage %d failed request %s", self.index, rid)
            await self._forward(pb.Activation(request_id=rid, epoch=self.epoch,
                                              error=f"stage {self.index} ({self.config.address}): {exc}"))
            if isinstance(exc, codec.TensorDecodeError):
                raise
            return
        nxt = pb.Activation(request_id=rid, epoch=self.epoch, step=message.step, offset=message.offset,
                            stage=(self.index + 1) % len(self.config.plan), sent_at=time.time())
        if isinstance(out, int):
            nxt.token = out
        else:
            nxt.hidden.CopyFrom(out)
            if message.HasField("sampling"):
                nxt.sampling.CopyFrom(message.sampling)
        await self._forward(nxt)

    async def _forward(self, message: pb.Activation) -> None:
        try:
            await self._next.send(message)
        except ConnectionError as exc:
            log.warning("request %s: %s", message.request_id, exc)

    # --- introspection -------------------------------------------------------------------

    def info(self) -> dict:
        """A JSON-safe summary of this node: stage, plan, state and live figures."""
        lat = list(self.hop_latency_s)
        return {
            "node_id": self.node_id,
            "address": self.config.address,
            "state": self.state,
            "epoch": self.epoch,
            "model": self.config.model.name,
            "num_layers": self.engine.stage.num_layers if self.engine else None,
            "stage": self.index,
            "layer_range": [self.stage_spec.start, self.stage_spec.end],
            "plan": [{"address": s.address, "start": s.start, "end": s.end} for s in self.config.plan],
            "requests_in_flight": len(self._generations),
            "kv_caches": self.engine.active_requests if self.engine else [],
            "hop_latency_median_s": statistics.median(lat) if lat else None,
            "memory": {**self.memory, "rss_bytes": psutil.Process().memory_info().rss,
                       "peak_rss_bytes": _peak_rss_bytes()},
            "recent_requests": list(self.recent),
        }


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
        try:
            async for message in request_iterator:
                received += 1
                try:
                    await self.node.on_activation(message)
                except codec.TensorDecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {exc}")
        except asyncio.CancelledError:
            raise
        yield pb.HopAck(received=received)

    async def Generate(self, request, context):  # noqa: N802
        node = self.node
        if not node.is_head:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node does not hold stage 0")
        try:
            async for token in node.generate(list(request.prompt), request.max_tokens,
                                             sampling_from_pb(request.sampling), frozenset(request.stop_ids),
                                             request_id=request.request_id or None):
                yield pb.GenerateEvent(token=token)
        except GenerationError as exc:
            yield pb.GenerateEvent(error=str(exc))

    async def GetNodeInfo(self, request, context):  # noqa: N802
        node = self.node
        return pb.NodeInfo(
            node_id=node.node_id, protocol_version=PROTOCOL_VERSION, grpc_port=node.config.port,
            model=node.config.model.name,
            num_layers=node.engine.stage.num_layers if node.engine else 0,
            plan=[pb.LayerRange(node_id="", start=s.start, end=s.end, grpc_address=s.address)
                  for s in node.config.plan],
            epoch=node.epoch, state=node.state,
        )

    async def Echo(self, request, context):  # noqa: N802
        return pb.Ping(payload=request.payload, sent_at=request.sent_at)
