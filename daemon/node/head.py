"""Stage 0 heading a generation: embed the prompt (in chunks), take each token the
last stage samples, embed it for the next step, until a stop token or ``max_tokens``;
then release the request's KV cache around the ring. A mixin of
:class:`ringlet.daemon.node.Node`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ringlet.daemon.engine.draft_length import Speculation, before_stop, next_drafts
from ringlet.daemon.engine.drafting import Drafter
from ringlet.daemon.engine.request_errors import RequestError, RequestRetry
from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.engine.sampling_pb import sampling_to_pb
from ringlet.daemon.engine.speculation import trimmable
from ringlet.daemon.errors import GenerationError, one_line
from ringlet.daemon.node.config import PREFILL_TIMEOUT_TOKENS, PREFIX_ATTEMPTS, SPEC_ALWAYS_ENV, TEST_CHUNK_DELAY_ENV
from ringlet.daemon.node.signals import PrefixMissed, RetryOnPlan
from ringlet.daemon.wire import codec
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger("ringlet.daemon.node")


@dataclass
class Generation:
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
    scope: str = ""
    cached: int = 0  # prompt tokens taken from the prefix stores
    prefilled: int = 0  # prompt tokens in stage 0's KV cache so far (cached ones included)
    on_prefill: Callable[[int, int, int], None] | None = None  # (processed, total, cached) tokens, per chunk
    drafter: Drafter | None = None  # speculative decoding (None: off for this request)
    spec: Speculation | None = None
    drafting: int = 0  # drafted tokens in the step in flight
    evidence: tuple[str, int] = ("", 0)  # what those drafts rest on (Drafter.evidence)
    sent_s: float = 0.0  # perf_counter() when the decode step in flight went out (0: not timed)
    info: dict | None = None

    def prefill_info(self) -> dict:
        """This request's prefill progress at stage 0: prompt tokens done of total, the
        cached ones included, and an ETA in seconds from the rate so far (None before
        the first computed chunk)."""
        elapsed = time.perf_counter() - self.started
        done = self.prefilled - self.cached
        left = len(self.prompt) - self.prefilled
        return {"request_id": self.request_id, "prompt_tokens": len(self.prompt), "cached_tokens": self.cached,
                "processed_tokens": self.prefilled, "elapsed_s": round(elapsed, 3),
                "eta_s": round(left * elapsed / done, 3) if done > 0 else None}

    def progressed(self, tokens: int) -> None:
        """Stage 0 holds the first ``tokens`` prompt tokens: tell the listener."""
        self.prefilled = tokens
        if self.on_prefill is not None:
            self.on_prefill(tokens, len(self.prompt), self.cached)


class Head:
    """Stage 0's part of :class:`ringlet.daemon.node.Node`."""

    # --- stage 0: heading a generation --------------------------------------------------

    def prefilling(self) -> list[dict]:
        """The requests this stage 0 is prefilling (no token yet): their progress
        (:meth:`Generation.prefill_info`), for ``GET /v1/cluster``."""
        return [gen.prefill_info() for gen in list(self._generations.values())
                if gen.ttft_s is None and not gen.finished]

    async def _generate_local(self, request_id: str, prompt: list[int], max_tokens: int,
                              sampling: SamplingParams, stop_ids: frozenset[int], scope: str = "",
                              info: dict | None = None, prediction: list[int] | None = None) -> AsyncIterator[int]:
        """Head a generation on this stage 0, reusing the longest prompt prefix that this
        stage's prefix store holds. A later stage lacking it answers with how much it
        holds, and the request starts again (under a new id) with at most that much,
        down to none: the ring always computes over one prefix length, so the output
        never depends on what the stores hold. ``info["cached_tokens"]`` gets the length
        used; ``info["drafts"]`` (accepted, rejected, trips) the speculative decoding
        figures, drafting from the prompt and ``prediction`` (the expected output's ids)."""
        cap = len(prompt) - 1  # at least one token is computed: its logits give the first token
        await self.await_installed()  # the KV that moved with its layers on a re-plan just now
        for attempt in range(PREFIX_ATTEMPTS + 1):
            rid = request_id if attempt == 0 else f"{request_id}~p{attempt}"
            reuse = 0
            if cap > 0 and attempt < PREFIX_ATTEMPTS and self.engine is not None:
                reuse = await self.engine.run(self.engine.prefix.longest, scope, prompt, cap)
                if reuse == 0:
                    await self.engine.run(self.engine.prefix.miss)
            try:
                async for token in self._generate_once(rid, prompt, max_tokens, sampling, stop_ids, scope, reuse,
                                                       info, prediction):
                    yield token
                return
            except PrefixMissed as miss:
                log.info("request %s: %s; prefilling with at most %d cached tokens", request_id, miss, miss.holds)
                cap = min(cap, miss.holds) if miss.holds < reuse else reuse - 1

    async def _generate_once(self, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                             stop_ids: frozenset[int], scope: str, reuse: int,
                             info: dict | None, prediction: list[int] | None = None) -> AsyncIterator[int]:
        if not self.is_head:
            raise GenerationError("this node does not hold stage 0 of the current plan")
        if request_id in self._generations:
            raise GenerationError(f"request id {request_id} is already in flight")
        gen = Generation(request_id, list(prompt), max_tokens, sampling, stop_ids, epoch=self.epoch, scope=scope,
                         cached=reuse, on_prefill=(info or {}).get("on_prefill"), info=info)
        if self._may_speculate():
            model = self.draft_model.session() if self.draft_model is not None else None
            gen.drafter = Drafter(prompt, prediction or (), model=model)
            gen.spec = Speculation(self.config.spec_tokens)
        self._generations[request_id] = gen
        gen.progressed(reuse)
        self.state = "serving"
        try:
            if max_tokens <= 0:
                return
            await self._advance(gen, step=0, payload=list(prompt))
            first = True
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
                if first and info is not None:
                    info.setdefault("cached_tokens", gen.cached)
                first = False
                yield item
        finally:
            if not gen.finished:
                gen.finished = True
                await self._release(request_id, gen.prompt + gen.tokens)
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

    async def _advance(self, gen: Generation, step: int, payload: list[int]) -> None:
        """Run stage 0 for ``payload`` and pass the result on (or take the token, on a
        single-stage plan). A prompt longer than ``prefill_chunk`` goes in chunks, each
        sent on as soon as it is computed (the next stage starts on it meanwhile). The
        first ``gen.cached`` prompt tokens come from the prefix stores: the first chunk
        names them (``prefix_ids``) and the prefill starts after them."""
        if step == 0:
            chunk = self.prefill_chunk
            pieces = [(off, payload[off:off + chunk]) for off in range(gen.cached, len(payload), chunk)]
        else:  # a decode step: the latest token, then the drafts to verify (if any)
            pieces = [(len(gen.prompt) + len(gen.tokens) - 1, payload)]
        for k, (offset, piece) in enumerate(pieces):
            more = k < len(pieces) - 1
            prefix = gen.prompt[:offset] if step == 0 and k == 0 and offset > 0 else None
            try:
                out = await self.engine.submit(gen.request_id, step, offset, piece, gen.sampling, more=more,
                                               prefix_ids=prefix, scope=gen.scope, drafts=gen.drafting if step else 0)
            except Exception as exc:  # fail this request only
                if not isinstance(exc, (RequestError, codec.TensorDecodeError)):
                    log.exception("stage 0 failed request %s", gen.request_id)
                kind = RetryOnPlan if isinstance(exc, RequestRetry) else GenerationError
                self._finish(gen, kind(f"stage 0: {one_line(exc)}"))
                return
            if gen.finished:
                return
            if step == 0:
                gen.progressed(offset + len(piece))
                if delay := float(os.environ.get(TEST_CHUNK_DELAY_ENV) or 0):  # tests only: a slow prefill
                    await asyncio.sleep(delay)
                    if gen.finished:
                        return
            if out is None:  # a single-stage plan filling its cache chunk by chunk
                continue
            if isinstance(out, (int, list)):
                self._on_tokens(gen, out if isinstance(out, list) else [out])
                return
            message = pb.Activation(request_id=gen.request_id, epoch=gen.epoch, step=step, offset=offset,
                                    hidden=out, stage=1, sent_at=time.time(), more=more, token_ids=piece,
                                    batch_ids=self.engine.batch_of(gen.request_id),
                                    drafts=gen.drafting if step else 0)
            if step == 0 and k == 0:
                message.sampling.CopyFrom(sampling_to_pb(gen.sampling))
                message.cache_scope = gen.scope
                if prefix:
                    message.prefix_ids.extend(prefix)
            try:
                await self._next.send(message)
            except (ConnectionError, AttributeError) as exc:
                self._finish(gen, GenerationError(f"next stage unreachable: {one_line(exc)}"))
                return

    def _on_tokens(self, gen: Generation, tokens: list[int]) -> None:
        """The last stage's answer to a step: one token, or a verifying step's accepted
        drafts then the next token. Each is streamed; a stop token or ``max_tokens`` cuts
        them exactly; then the next step goes out with the latest token and new drafts."""
        if gen.finished:
            return
        if gen.ttft_s is None:
            gen.ttft_s = time.perf_counter() - gen.started
        if gen.sent_s:  # a decode trip while this request decoded alone here: what it cost
            self.trip_meter.observe(gen.drafting, time.perf_counter() - gen.sent_s)
            gen.sent_s = 0.0
        if gen.drafting:
            gen.spec.verified(gen.drafting, len(tokens) - 1, gen.evidence)
            gen.drafter.verified(len(tokens) - 1)
            self.spec_totals.count(gen.drafting, len(tokens) - 1)
            gen.drafting = 0
            if gen.info is not None:
                gen.info["drafts"] = (gen.spec.accepted, gen.spec.rejected, gen.spec.trips)
        for k, token in enumerate(tokens):
            gen.tokens.append(token)
            self.tokens_generated_total += 1
            self._token_times.append(time.monotonic())
            gen.queue.put_nowait(token)
            if token in gen.stop_ids or len(gen.tokens) >= gen.max_tokens:
                if gen.drafter is not None:
                    gen.drafter.add(tokens[:k + 1])
                self._finish(gen, None)
                return
        drafts, k = self._drafts(gen, tokens)
        gen.sent_s = time.perf_counter() if gen.drafter is not None and len(self._generations) == 1 else 0.0
        if not drafts and k > 0 and gen.drafter.model is not None:  # the draft model's turn (its time is the trip's)
            asyncio.ensure_future(self._draft_then_advance(gen, tokens[-1], k))
            return
        gen.drafting = len(drafts)
        asyncio.ensure_future(self._advance(gen, step=len(gen.tokens), payload=[tokens[-1], *drafts]))

    async def _draft_then_advance(self, gen: Generation, latest: int, k: int) -> None:
        """Draft ``k`` tokens with the draft model, on the engine's thread (MLX runs
        there), then send the step; a draft model that fails sends it without drafts."""
        try:
            drafts = before_stop(await self.engine.run(gen.drafter.propose_by_model, list(gen.tokens), k), gen.stop_ids)
        except Exception as exc:  # noqa: BLE001 - drafts are optional: the step goes on without them
            log.warning("request %s: the draft model failed (%s); decoding without its drafts", gen.request_id,
                        one_line(exc))
            gen.drafter.model, drafts = None, []
        if gen.finished:
            return
        gen.drafting = len(drafts)
        await self._advance(gen, step=len(gen.tokens), payload=[latest, *drafts])

    def _may_speculate(self) -> bool:
        """Whether this stage 0 drafts for a new request: drafts are on (``--spec-tokens``),
        this node holds stage 0 (its own layers, or a hybrid plan's tensor group), and every
        layer's KV cache can drop rejected positions exactly (mlx-lm's plain ``KVCache``, in
        this process or in the group's ranks; not a rotating window or a recurrent state),
        and every node of the committed plan speaks drafts (:attr:`ServingPlan.drafts`; a
        request's ``prediction`` is then not used). Counted in :attr:`spec_totals` when not."""
        if self.config.spec_tokens <= 0:
            return False
        if self.plan is not None and not self.plan.drafts:  # a node taking part runs an older release
            self.spec_totals.skip("versions")
            return False
        stage = self.engine.stage if self.engine is not None else None
        if stage is None:
            return False
        pattern = getattr(stage, "pattern", None)
        if not trimmable(pattern.caches if pattern is not None else stage.make_cache()):
            self.spec_totals.skip("cache")
            return False
        return True

    def _drafts(self, gen: Generation, new: list[int]) -> tuple[list[int], int]:
        """The drafts for ``gen``'s next step from the prediction or prompt lookup, and
        how many it may draft (the draft model's allowance when those give none): none
        while other requests decode here (their steps batch instead) or while its
        drafts do not pay for their trips
        (:class:`~ringlet.daemon.engine.draft_length.TripMeter`), at most the tokens ``max_tokens`` leaves after the
        next one, and cut before a stop token (the model's own draw decides a stop)."""
        if gen.drafter is None:
            return [], 0
        gen.drafter.add(new)
        if len(self._generations) > 1:
            self.spec_totals.skip("batching")
            return [], 0
        meter = self.trip_meter if os.environ.get(SPEC_ALWAYS_ENV) != "1" else None
        drafts, k = next_drafts(gen.drafter, gen.spec, gen.tokens, gen.max_tokens - len(gen.tokens) - 1, gen.stop_ids,
                                meter)
        gen.evidence = gen.drafter.evidence
        return drafts, k

    def _finish(self, gen: Generation, error: Exception | None) -> None:
        if gen.finished:
            return
        gen.finished = True
        gen.queue.put_nowait(error)
        asyncio.ensure_future(self._release(gen.request_id, gen.prompt + gen.tokens))

    async def _release(self, request_id: str, token_ids: list[int] | None = None) -> None:
        """Drop the request's cache here and send a release around the ring; with
        ``token_ids`` (the request's tokens), every stage keeps its cache in its prefix
        store first."""
        if self.engine is not None:
            await self.engine.submit_release(request_id, token_ids)
        if self._next is not None and self.is_head:
            try:
                await self._next.send(pb.Activation(request_id=request_id, epoch=self.epoch, release=True,
                                                    token_ids=token_ids or []))
            except ConnectionError as exc:
                log.debug("could not send release of %s: %s", request_id, exc)

