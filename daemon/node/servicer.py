"""The gRPC face of a node: the ``Ring`` service of ``proto/ringlet.proto``.

Hops and generations go to the node; membership, negotiation and tensor ranks to
the parts the runner attached (``node.cluster``, ``node.tp``); shard transfers to
:mod:`ringlet.daemon.shards`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING

import grpc

from ringlet.daemon.cluster import features
from ringlet.daemon.engine.sampling_pb import sampling_from_pb, scores_to_pb
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.node.signals import EpochSkew, PlanChanged, RetryOnPlan
from ringlet.daemon.wire import codec, versions
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ringlet.daemon.node.core import Node


async def _produce(source, info: dict, events: asyncio.Queue) -> None:
    """Put the generation's tokens (with their scores; the first with the cached-token
    count) on ``events``, or its error, then ``None``; the prefill progress that
    ``info["on_prefill"]`` reports goes on the same queue, in order."""
    first = True
    try:
        async for token in source:
            accepted, rejected, trips = info.get("drafts", (0, 0, 0))
            events.put_nowait(pb.GenerateEvent(token=token, cached_tokens=info.get("cached_tokens", 0) if first else 0,
                                               scores=scores_to_pb(token), accepted_drafts=accepted,
                                               rejected_drafts=rejected, draft_trips=trips))
            first = False
    except GenerationError as exc:
        events.put_nowait(pb.GenerateEvent(error=str(exc), retry=isinstance(exc, RetryOnPlan),
                                           skew=isinstance(exc, EpochSkew),
                                           plan_epoch=exc.epoch if isinstance(exc, PlanChanged) else 0))
    finally:
        await source.aclose()
        events.put_nowait(None)


class RingServicer(pb_grpc.RingServicer):
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
        events: asyncio.Queue[pb.GenerateEvent | None] = asyncio.Queue()

        def on_prefill(processed: int, total: int, cached: int) -> None:
            events.put_nowait(pb.GenerateEvent(progress=pb.PrefillProgress(processed=processed, total=total,
                                                                           cached=cached)))

        # an API node of an older release reads an unknown event as a token: progress only when every member reads it
        speak = features.members_speak(node.cluster, versions.PREFILL_PROGRESS)
        info: dict = {"on_prefill": on_prefill} if speak else {}
        source = node.head_source(request.request_id or uuid.uuid4().hex, list(request.prompt), request.max_tokens,
                                  sampling_from_pb(request.sampling), frozenset(request.stop_ids),
                                  request.cache_scope, info, list(request.prediction))
        producer = asyncio.ensure_future(_produce(source, info, events))
        try:
            while (event := await events.get()) is not None:
                yield event
        finally:
            if not producer.done():
                producer.cancel()  # the caller left: the generation stops where it waits, its KV is released
            await asyncio.wait([producer])
    async def GetNodeInfo(self, request, context):  # noqa: N802
        node = self.node
        cluster = node.cluster
        if cluster is not None and request.caller_address:
            cluster.membership.consider(request.caller_address, request.caller_id or None)
        stage = node.engine.stage if node.engine else None
        return pb.NodeInfo(
            node_id=node.node_id, protocol_version=versions.PROTOCOL_VERSION, cluster_id=node.cluster_id,
            grpc_port=node.config.port, model=node.config.model.name,
            num_layers=stage.num_layers if stage else 0,
            plan=[pb.LayerRange(node_id=s.node_id, start=s.start, end=s.end, grpc_address=s.address)
                  for s in (node.plan.stages if node.plan else ())],
            epoch=node.epoch, state=node.state, incarnation=node.incarnation,
            record_json=json.dumps(cluster.membership.own_record) if cluster else "",
            record_version=cluster.membership.record_version if cluster else 0,
            plan_json=node.plan_json(),
            leaving=bool(cluster is not None and cluster.membership.leaving),
        )

    async def Echo(self, request, context):  # noqa: N802
        if request.echo:
            return pb.Ping(payload=request.payload, sent_at=request.sent_at)
        return pb.Ping(sent_at=request.sent_at)

    async def ShardManifest(self, request, context):  # noqa: N802
        from ringlet.daemon.shards import serve as shard_serve

        return await shard_serve.serve_manifest(request, context, self.node.config.model)

    async def FetchShard(self, request, context):  # noqa: N802
        from ringlet.daemon.shards import serve as shard_serve

        async for chunk in shard_serve.serve_fetch(request, context, self.node.config.model):
            yield chunk

    async def FetchKV(self, request, context):  # noqa: N802
        if request.end <= request.start:
            yield pb.KVChunk(error=f"empty layer range [{request.start}, {request.end})")
            return
        async for chunk in self.node.serve_kv(request):
            yield chunk

    async def FetchBoundary(self, request, context):  # noqa: N802
        async for chunk in self.node.serve_boundary(request):
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
