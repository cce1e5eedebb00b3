"""Any stage's part of the ring: take an activation from the previous stage, queue
its step on the engine, and send the result (hidden states, or the sampled token
from the last stage) or the request's error on. A mixin of
:class:`ringlet.daemon.node.Node`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ringlet.daemon.engine.request_errors import PrefixMiss, RequestDropped, RequestError, RequestRetry
from ringlet.daemon.engine.sampling_pb import sampling_from_pb, scores_to_pb, token_from_pb, tokens_from_pb
from ringlet.daemon.errors import GenerationError, one_line
from ringlet.daemon.node.signals import EpochSkew, PrefixMissed, RetryOnPlan
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger("ringlet.daemon.node")


class Relay:
    """Incoming activations of :class:`ringlet.daemon.node.Node`."""

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
        if message.epoch > self.epoch:
            await self.await_commit(message.epoch)
        if self.is_head and message.epoch <= self.epoch:
            gen = self._generations.get(rid)
            if gen is None or message.epoch != gen.epoch:
                return  # a late token or error for a finished request or an old plan
            if message.error and message.prefix_miss:
                self._finish(gen, PrefixMissed(message.error, message.prefix_holds))
            elif message.error and message.behind:
                self._finish(gen, EpochSkew(message.error))  # that stage commits this epoch momentarily
            elif message.error:
                self._finish(gen, (RetryOnPlan if message.retry else GenerationError)(message.error))
            elif message.tokens:
                self._on_tokens(gen, tokens_from_pb(message))
            elif message.WhichOneof("payload") == "token":
                self._on_tokens(gen, [token_from_pb(message)])
            return
        if self.index is None or message.epoch != self.epoch:
            if message.WhichOneof("payload") == "hidden" and not message.release:
                await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                                  error=f"stage at {self.config.address} serves epoch "
                                                        f"{self.epoch}, not {message.epoch}",
                                                  behind=message.epoch > self.epoch))
            return
        if message.release:
            self._spawn(self._release_and_forward(message))
            return
        if message.error:
            await self._forward(message)
            return
        if message.WhichOneof("payload") != "hidden":
            raise codec.TensorDecodeError("activation carries no hidden states")
        if message.step == 0:
            await self.await_installed()  # a resumed request reuses the KV that moved with its layers
        if (error := self.engine.shape_error(tuple(message.hidden.shape))) is not None:
            await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                              error=f"stage {self.index} ({self.config.address}): {error}"))
            raise codec.TensorDecodeError(error)
        sampling = sampling_from_pb(message.sampling) if message.HasField("sampling") else None
        future = self.engine.submit(rid, message.step, message.offset, message.hidden, sampling, more=message.more,
                                    prefix_ids=list(message.prefix_ids), scope=message.cache_scope,
                                    ids=list(message.token_ids) if message.token_ids else None,
                                    siblings=list(message.batch_ids) or None, drafts=message.drafts)
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
            miss = isinstance(exc, PrefixMiss)
            await self._forward(pb.Activation(request_id=rid, epoch=message.epoch,
                                              error=f"stage {self.index} ({self.config.address}): {one_line(exc)}",
                                              retry=isinstance(exc, RequestRetry), prefix_miss=miss,
                                              prefix_holds=exc.holds if miss else 0))
            return
        if out is None:
            return  # the last stage took a prefill chunk that more chunks follow
        nxt = pb.Activation(request_id=rid, epoch=message.epoch, step=message.step, offset=message.offset,
                            stage=(self.index + 1) % len(self.plan.stages), sent_at=time.time(), more=message.more,
                            batch_ids=self.engine.batch_of(rid))
        if isinstance(out, list):  # a verifying step: the accepted drafts, then the next token
            nxt.tokens.extend(out)
            if any(getattr(t, "logprob", None) is not None for t in out):
                nxt.token_scores.extend(scores_to_pb(t) or pb.TokenScores() for t in out)
        elif isinstance(out, int):
            nxt.token = out
            if (scores := scores_to_pb(out)) is not None:
                nxt.scores.CopyFrom(scores)
        else:
            nxt.hidden.CopyFrom(out)
            if message.HasField("sampling"):
                nxt.sampling.CopyFrom(message.sampling)
            nxt.cache_scope = message.cache_scope
            nxt.prefix_ids.extend(message.prefix_ids)
            nxt.token_ids.extend(message.token_ids)
            nxt.drafts = message.drafts
        await self._forward(nxt)

    async def _release_and_forward(self, message: pb.Activation) -> None:
        await self.engine.submit_release(message.request_id, list(message.token_ids))
        if not self.is_last:
            await self._forward(message)

    async def _forward(self, message: pb.Activation) -> None:
        if self._next is None:
            return
        try:
            await self._next.send(message)
        except ConnectionError as exc:
            log.warning("request %s: %s", message.request_id, exc)

