"""The API node's side of a generation: any node takes the request, runs it on the
committed plan's stage 0 (here or over gRPC), and owns its tokens so far.

When the plan changes or a stage fails mid-stream, :meth:`ResumingClient.generate`
resumes the request on the next plan by re-prefilling prompt + tokens so far, so the
client sees one stream. A mixin of :class:`ringlet.daemon.node.Node`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from ringlet.daemon.engine import kv_room
from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.engine.sampling_pb import sampling_to_pb, token_from_pb
from ringlet.daemon.engine.stage import token_id_error
from ringlet.daemon.errors import GenerationError, NoPlanError, one_line
from ringlet.daemon.node.config import EPOCH_SKEW_RETRY_S, RESUME_WAIT_S, SPEC_ALWAYS_ENV
from ringlet.daemon.node.signals import EpochSkew, PlanChanged, RetryOnPlan
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.serving_plan import ServingPlan
from ringlet.daemon.wire.transport import make_channel

log = logging.getLogger("ringlet.daemon.node")


class ResumingClient:
    """Generation as any node serves it: wait for a plan, try, resume on failure."""

    # --- generation (public, any node) ---------------------------------------------------

    async def _wait_plan(self, newer_than: int = 0, timeout_s: float | None = None) -> ServingPlan:
        """The committed plan with epoch > ``newer_than`` (waits for one while the cluster
        forms or re-plans).

        Raises:
            NoPlanError: the committed plan cannot serve the model, or none came in time.
        """
        deadline = time.monotonic() + (self.config.plan_wait_s if timeout_s is None else timeout_s)
        while True:
            if kept_out := getattr(getattr(self.cluster, "agreement", None), "kept_out_reason", None):
                raise NoPlanError(kept_out)  # this node holds another model than the cluster serves
            plan = self.plan
            if plan is not None and plan.epoch > newer_than:
                if plan.infeasible:
                    raise NoPlanError(plan.infeasible)
                return plan
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if plan is not None and plan.infeasible:
                    raise NoPlanError(plan.infeasible)
                raise NoPlanError(self._no_plan_yet())
            waiter = self._plan_changed
            try:
                await asyncio.wait_for(waiter.wait(), timeout=remaining)
            except TimeoutError:
                pass

    def _no_plan_yet(self) -> str:
        """Why no plan serves yet: forming or re-planning, and the reason the last proposal
        this node made was not taken (a member that cannot load its stage: a full disk, a
        failed download), when there is one."""
        text = "the cluster has no serving plan yet (still forming or re-planning)"
        last = getattr(self.cluster, "last_result", "") or ""
        if last and not last.endswith(" committed"):
            text += f"; the last proposal was not taken: {last}"
        return text

    async def _await_replan(self, plan: ServingPlan, exc: GenerationError, timeout_s: float | None) -> None:
        """Wait for a plan newer than ``plan`` after ``exc`` ended a try on it.

        Raises:
            NoPlanError: the newer plan cannot serve the model.
            GenerationError: ``exc`` itself, when no newer plan came in ``timeout_s``
                seconds (``None``: the configured plan wait).
        """
        try:
            await self._wait_plan(newer_than=plan.epoch, timeout_s=timeout_s)
        except NoPlanError:
            if self.plan is not None and self.plan.infeasible:
                raise
            raise exc from None

    async def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int] | set[int], request_id: str | None = None,
                       cache_scope: str = "", info: dict | None = None,
                       prediction: list[int] | None = None) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` tokens after ``prompt``; yields token ids as they come.

        Stops after a token in ``stop_ids`` (that token is yielded). Works on any node:
        the request runs on the committed plan's stage 0 (here or over gRPC). If the
        plan changes or a stage fails mid-stream, the request resumes on the next
        plan by re-prefilling prompt + tokens so far; the caller sees one stream.

        The longest prompt prefix the stages' prefix stores hold under ``cache_scope``
        is reused; ``info["cached_tokens"]`` gets how many prompt tokens that was.
        Stage 0 drafts tokens from the prompt, the output and ``prediction`` (the token
        ids the caller expects the output to be, OpenAI's Predicted Outputs) and verifies
        them in one trip (speculative decoding, exact); ``info["drafts"]`` gets
        (accepted, rejected, trips).

        Raises:
            NoPlanError: no plan can serve the model (the message says why).
            GenerationError: the request failed and could not be resumed.
        """
        request_id = request_id or uuid.uuid4().hex
        if (why := self.prompt_error(prompt, max_tokens)) is not None:
            raise GenerationError(why)
        produced: list[int] = []
        stop_ids = frozenset(stop_ids)
        attempts = skews = 0
        while len(produced) < max_tokens:
            plan = await self._wait_plan()
            resumed = replace(sampling, steps_done=sampling.steps_done + len(produced))
            again = attempts + skews > 0  # a resume: count what it prefilled again
            tried, context = ({} if again else info), prompt + produced
            try:
                async for token in self._attempt(plan, request_id, context, max_tokens - len(produced),
                                                 resumed, stop_ids, cache_scope, tried, prediction):
                    if again:
                        again = False
                        self.count_resume(len(context), tried.get("cached_tokens", 0))
                    produced.append(token)
                    yield token
                    if token in stop_ids:
                        return
                return
            except NoPlanError:
                raise
            except GenerationError as exc:
                if kv_room.MARK in str(exc):  # no memory for its KV: the same again would fail too
                    raise
                skewed = isinstance(exc, EpochSkew)
                skews += skewed
                attempts += not skewed
                if attempts > self.config.resume_attempts or skews * EPOCH_SKEW_RETRY_S > RESUME_WAIT_S:
                    raise
                log.info("request %s: %s; resuming after %d tokens", request_id, exc, len(produced))
                self.event("resume", f"request {request_id[:8]} resumes after {len(produced)} tokens: {exc}")
                if skewed:
                    await asyncio.sleep(EPOCH_SKEW_RETRY_S)  # stage 0 commits the same plan momentarily
                elif isinstance(exc, RetryOnPlan):
                    pass  # the plan stands and its stage recovered: prefill again on it
                elif isinstance(exc, PlanChanged) and exc.epoch > self.epoch:
                    # stage 0 committed a newer plan than this node has: its commit is on
                    # the way (or a re-proposal heals a split commit), so wait the full
                    # plan wait for it rather than take the error for a failed stage
                    await self._await_replan(plan, exc, timeout_s=None)
                elif self.plan is not None and self.plan.epoch == plan.epoch:
                    # A stage failure is followed by a re-plan within seconds (heartbeats,
                    # then negotiation). If none comes, the failure is not the cluster's
                    # shape but the request itself: report it instead of retrying it.
                    await self._await_replan(plan, exc, timeout_s=min(self.config.step_timeout_s, RESUME_WAIT_S))
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
                       sampling: SamplingParams, stop_ids: frozenset[int], scope: str = "",
                       info: dict | None = None, prediction: list[int] | None = None) -> AsyncIterator[int]:
        """One try of a generation on ``plan``; raises :class:`PlanChanged` as soon as
        this node commits another plan."""
        changed = self._plan_changed
        if plan is not self.plan:
            raise PlanChanged("the plan changed before the request started")
        head = plan.stages[0]
        if plan.index_of(self.node_id, self.config.address) == 0:
            source = self.head_source(request_id, prompt, max_tokens, sampling, stop_ids, scope, info, prediction)
        else:
            source = self._generate_remote(head.address, plan.epoch, request_id, prompt, max_tokens, sampling,
                                           stop_ids, scope, info, prediction)
        it = source.__aiter__()
        change = asyncio.ensure_future(changed.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt, change}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    raise PlanChanged(f"the plan changed to epoch {self.epoch}")
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
                               scope: str = "", info: dict | None = None,
                               prediction: list[int] | None = None) -> AsyncIterator[int]:
        stub = pb_grpc.RingStub(self._channel(address))
        call = stub.Generate(pb.GenerateRequest(
            request_id=request_id, prompt=prompt, max_tokens=max_tokens, epoch=epoch,
            sampling=sampling_to_pb(sampling), stop_ids=sorted(stop_ids), cache_scope=scope,
            prediction=prediction or []))
        first = True
        on_prefill = (info or {}).get("on_prefill")
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "progress":  # stage 0 reports its prefill: pass it on to the API's stream
                    if on_prefill is not None:
                        p = event.progress
                        on_prefill(p.processed, p.total, p.cached)
                    continue
                if kind == "error":
                    if event.plan_epoch:
                        raise PlanChanged(event.error, event.plan_epoch)
                    if event.skew:
                        raise EpochSkew(event.error)
                    raise (RetryOnPlan if event.retry else GenerationError)(event.error)
                if first and info is not None:
                    info.setdefault("cached_tokens", event.cached_tokens)
                first = False
                if info is not None and event.draft_trips:
                    info["drafts"] = (event.accepted_drafts, event.rejected_drafts, event.draft_trips)
                yield token_from_pb(event)
        except grpc.aio.AioRpcError as exc:
            error = EpochSkew if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else GenerationError
            raise error(f"stage 0 ({address}): {one_line(exc)}") from None
        finally:
            call.cancel()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = make_channel(self.config.transport, address)
            self._channels[address] = ch
        return ch

    def _group_spec(self, prediction: list[int] | None) -> dict | None:
        """Speculative decoding for a request rank 0 of this node's tensor group drives:
        ``{"k", "prediction", "measured"}``, or ``None`` when drafts are off (``--spec-tokens
        0``, or a rank of an older release: :attr:`ServingPlan.drafts`); the group drops it
        where its KV caches cannot drop drafted positions exactly.
        The draft model (``--draft-model``) runs for pipeline stage 0s only."""
        if self.config.spec_tokens <= 0:
            return None
        if self.plan is not None and not self.plan.drafts:  # a rank runs an older release
            self.spec_totals.skip("versions")
            return None
        return {"k": self.config.spec_tokens, "prediction": list(prediction or ()),
                "measured": os.environ.get(SPEC_ALWAYS_ENV) != "1"}

    def head_source(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                    stop_ids: frozenset[int], scope: str = "", info: dict | None = None,
                    prediction: list[int] | None = None) -> AsyncIterator[int]:
        """This node heads the request: stage 0 of a pipeline, or rank 0 of a tensor group
        (whose prefix cache lives in its ranks: :mod:`ringlet.daemon.tensor.rank_prefix`)."""
        if self.plan is not None and self.plan.is_tensor and self.tp is not None:
            return self.tp.generate(request_id, prompt, max_tokens, sampling, stop_ids, scope, info,
                                    self._group_spec(prediction))
        return self._generate_local(request_id, prompt, max_tokens, sampling, stop_ids, scope, info, prediction)

