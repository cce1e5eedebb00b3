"""One path inside: a :class:`GenerationRequest` in, a stream of events out.

:meth:`Pipeline.prepare` checks the request and renders its prompt (a 400 naming the
field otherwise); :meth:`Pipeline.run` generates on the ring (``Node.generate``) and
turns token ids into :mod:`ringlet.daemon.api.request` events: visible text (stop
strings cut it), reasoning (between the model's think tokens, detected by mlx-lm's
``TokenizerWrapper``), tool calls (streamed while written, by
:mod:`ringlet.daemon.api.call_stream`), log-probabilities, and the finish reason of each
of ``n`` choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from ringlet.daemon.api import prompting, ticker
from ringlet.daemon.api.call_stream import CallStream
from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.request import (
    Event,
    Finished,
    GenerationRequest,
    PromptProgress,
    ReasoningDelta,
    Started,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from ringlet.daemon.api.text import TextSplitter, whole_characters
from ringlet.daemon.api.tokenizer import LazyTokenizer
from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.node import Node
from ringlet.daemon.wire.limits import ApiLimits

#: the events that carry output (what /metrics times: first output, then between outputs)
OUTPUTS = (TextDelta, ReasoningDelta, ToolCallStart, ToolCallDelta, ToolCall)


@dataclass
class Prepared:
    """A checked request: its prompt, budget, sampling and tool format."""

    request: GenerationRequest
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    tool_format: prompting.ToolFormat | None
    thinking: bool  # the prompt leaves a think block open: the output starts as reasoning
    prediction_ids: list[int] | None = None  # the request's prediction, tokenized (drafts)


def keyed_scope(scope: str, cache_key: str) -> str:
    """The prefix-cache scope of a request that names a ``prompt_cache_key``: a digest of
    the API key's scope and the cache key, so entries are shared only by requests with
    both equal (OpenAI: requests with the same key share a cache). ``scope`` unchanged
    when ``cache_key`` is empty. 32 hex digits, as the API key scopes are."""
    if not cache_key:
        return scope
    raw = scope.encode() + b"\0" + cache_key.encode("utf-8", "surrogateescape")
    return hashlib.sha256(b"ringlet prompt_cache_key\0" + raw).hexdigest()[:32]


class Pipeline:
    """Turns requests into event streams for one node.

    Args:
        node: the serving node.
        tokenizer: the model's mlx-lm ``TokenizerWrapper``, built on first use
            (:meth:`admit` and :meth:`ready` wait for it; the other methods need it built).
        model_name: the served model's id (requests naming another get a 404).
        context_tokens: the model's context length, tokens.
        limits: the API's limits (prompt and completion caps).
    """

    def __init__(self, node: Node, tokenizer: LazyTokenizer, model_name: str, context_tokens: int,
                 limits: ApiLimits):
        self.node, self.tokens, self.model_name = node, tokenizer, model_name
        self.context_tokens, self.limits = context_tokens, limits
        self.metrics = None  # /metrics (api/metrics.py): times and counts each run's outputs when set

    async def ready(self) -> None:
        """Wait until the tokenizer is built (at once after the first request)."""
        await self.tokens.get()

    @property
    def tokenizer(self):
        """The model's mlx-lm ``TokenizerWrapper`` (built: see :meth:`ready`)."""
        return self.tokens.value

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a completion."""
        return frozenset(self.tokenizer.eos_token_ids)

    # --- checking -----------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Raises ApiError (404) when ``model`` names a model this cluster does not serve."""
        if model not in (None, "", self.model_name):
            raise ApiError(404, f"model {model!r} is not served here; this cluster serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def prompt_ids(self, request: GenerationRequest) -> tuple[list[int], prompting.ToolFormat | None]:
        """The request's prompt token ids (after its ``context_ids``) and tool format (no
        budget check)."""
        if request.context_ids:
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in request.context_ids):
                raise ApiError(400, f"context token ids must be within [0, {vocab})", param="context")
            ids, fmt = self.prompt_ids(replace(request, context_ids=[]))
            return [*request.context_ids, *ids], fmt
        if request.messages is not None:
            return prompting.chat_prompt(self.tokenizer, request)
        if isinstance(request.prompt, list):
            vocab = len(self.tokenizer)
            if not request.prompt or any(t < 0 or t >= vocab for t in request.prompt):
                raise ApiError(400, f"prompt token ids must be a non-empty list within [0, {vocab})", param="prompt")
            return list(request.prompt), None
        ids = self.tokenizer.encode(request.prompt or "")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids, None

    def budget(self, prompt_len: int, wanted: int | None) -> int:
        """The completion tokens a prompt of ``prompt_len`` tokens may have.

        Raises:
            ApiError: the prompt does not fit the context or the node's prompt cap (400).
        """
        if prompt_len >= self.context_tokens:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; the model's context is {self.context_tokens}",
                           param="messages", code="context_length_exceeded")
        if (too_long := self.limits.prompt_error(prompt_len)) is not None:
            raise ApiError(400, too_long, param="messages", code="context_length_exceeded")
        room = self.context_tokens - prompt_len
        return self.limits.clamp_completion(min(wanted or room, room))

    async def admit(self, model: str | None, convert: Callable[[], GenerationRequest], scope: str) -> Prepared:
        """An adapter's request, checked and prepared: ``model`` must be the one served,
        ``convert()`` builds the internal request, which runs under the prefix-cache
        ``scope``. The node's first request waits here for the tokenizer.

        Raises:
            ApiError: another model (404), or a field that cannot be honoured (400).
        """
        self.check_model(model)
        request = convert()
        request.cache_scope = keyed_scope(scope, request.cache_key)
        await self.ready()
        return self.prepare(request)

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Check a request and render its prompt.

        Raises:
            ApiError: a field is out of range or unusable (400 naming it).
        """
        vocab = len(self.tokenizer)
        for token in request.logit_bias:
            if not 0 <= token < vocab:
                raise ApiError(400, f"logit_bias names token {token}, outside [0, {vocab})", param="logit_bias")
        grammar = prompting.output_grammar(request)
        ids, fmt = self.prompt_ids(request)
        max_tokens = self.budget(len(ids), request.max_tokens)
        # top_k >= vocabulary keeps every token (= off); a seed outside uint64 (the wire type) is reduced
        top_k = request.top_k if request.top_k < vocab else 0
        sampling = SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=top_k, min_p=request.min_p,
            seed=None if request.seed is None else request.seed % 2**64,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty, logit_bias=tuple(sorted(request.logit_bias.items())),
            logprobs=-1 if request.logprobs is None else request.logprobs, grammar=grammar)
        thinking = False
        if getattr(self.tokenizer, "has_thinking", False) and request.messages is not None:
            thinking = self.tokenizer.rfind_think_start(ids) > self.tokenizer.rfind_think_end(ids)
        prediction = self.tokenizer.encode(request.prediction, add_special_tokens=False) if request.prediction else None
        return Prepared(request, ids, max_tokens, sampling, fmt, thinking, prediction)

    # --- running ------------------------------------------------------------------------

    async def run(self, prepared: Prepared) -> AsyncIterator[Event]:
        """The events of a prepared request: :class:`Started`, then per choice its
        deltas and :class:`Finished`, then :class:`Usage`, under the request's
        prefix-cache scope (set by :meth:`admit`). Meanwhile a
        :class:`Keepalive` whenever nothing came for :func:`ticker.keepalive_interval`
        seconds, and with ``request.progress`` a :class:`PromptProgress` per prefill
        chunk. Closing it stops the generation (between two prefill chunks on stage 0).

        Raises:
            GenerationError: the ring failed the request (after its retries).
        """
        req = prepared.request
        yield Started(len(prepared.prompt_ids), tuple(prepared.prompt_ids),
                      self.tokenizer.decode(prepared.prompt_ids) if req.echo else "")
        info: dict = {}
        progress: asyncio.Queue[PromptProgress] | None = asyncio.Queue() if req.progress else None
        if progress is not None:
            started = time.perf_counter()

            def on_prefill(processed: int, total: int, cached: int) -> None:
                ms = int((time.perf_counter() - started) * 1000)
                progress.put_nowait(PromptProgress(total, cached, processed, ms))

            info["on_prefill"] = on_prefill
        events = ticker.with_ticks(self._choices(prepared, req.cache_scope, info), ticker.keepalive_interval(),
                                   progress)
        clock = self.metrics.clock() if self.metrics is not None else None
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if clock is not None and isinstance(event, OUTPUTS):
                    clock.output()
                elif clock is not None and isinstance(event, Usage):
                    clock.usage(event.prompt_tokens, event.cached_tokens, event.completion_tokens)
                yield event

    async def _choices(self, prepared: Prepared, scope: str, info: dict) -> AsyncIterator[Event]:
        """The events of :meth:`run` after :class:`Started`: each choice's, then
        :class:`Usage`; the first choice's generation reports through ``info``."""
        req = prepared.request
        total = 0
        drafts = [0, 0, 0]  # accepted, rejected, trips
        for choice in range(req.n):
            sampling = prepared.sampling
            if choice and sampling.seed is not None:  # n seeded choices: n different draws, each reproducible
                sampling = replace(sampling, seed=(sampling.seed + choice) % 2**64)
            own = info if choice == 0 else {}
            one = self._choice(prepared, choice, sampling, scope, own)
            async with contextlib.aclosing(one) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        total += event.completion_tokens
                    yield event
            drafts = [a + b for a, b in zip(drafts, own.get("drafts", (0, 0, 0)), strict=True)]
        yield Usage(len(prepared.prompt_ids), total, int(info.get("cached_tokens", 0)), *drafts)

    async def _choice(self, prepared: Prepared, choice: int, sampling: SamplingParams, scope: str,
                      info: dict) -> AsyncIterator[Event]:
        req, tok = prepared.request, self.tokenizer
        detok = tok.detokenizer
        fmt = prepared.tool_format
        splitter = TextSplitter(req.stop, (fmt.start, fmt.end) if fmt is not None else None)
        think_ids = ((tok.think_start_id, tok.think_end_id) if getattr(tok, "has_thinking", False)
                     else (None, None))
        thinking = prepared.thinking
        ids: list[int] = []
        pending: list[TokenLogprob] = []
        calls = CallStream(fmt, req.tools, choice) if fmt is not None else None
        unsent: list[int] = []  # ids of think tokens not yet reported (return_token_ids)
        consumed = 0  # characters of the detokenized text already given out
        finish = "length"
        one_call = False
        generation = self.node.generate(prepared.prompt_ids, prepared.max_tokens, sampling, self.eos_ids,
                                        cache_scope=scope, info=info, prediction=prepared.prediction_ids)
        async with contextlib.aclosing(generation) as tokens:
            async for token in tokens:
                ids.append(int(token))
                if token in self.eos_ids:
                    finish = "stop"
                    break
                if req.logprobs is not None and getattr(token, "logprob", None) is not None:
                    pending.append(self._logprob(token))
                if token in think_ids and think_ids[0] is not None:
                    thinking = token == think_ids[0]
                    unsent.append(int(token))
                    continue
                before = len(detok.text)
                detok.add_token(int(token))
                piece = detok.text[before:]
                consumed = len(detok.text)
                if thinking:
                    unsent.append(int(token))
                    if piece:
                        yield ReasoningDelta(piece, choice)
                    continue
                events = self._split(splitter.feed(piece), calls, choice, pending)
                if req.return_token_ids:  # one delta per token, carrying its id (streamed timing)
                    events = self._with_ids(events, choice, [*unsent, int(token)], pending)
                    unsent = []
                for event in events:
                    yield event
                    if isinstance(event, ToolCall) and not req.parallel_tool_calls:
                        one_call = True  # parallel_tool_calls false: the reply ends with its first call
                        break
                if splitter.stopped or one_call:
                    finish = "stop"
                    break
        detok.finalize()
        tail = whole_characters(detok.text)[consumed:]  # what finalize released (or "")
        if thinking and tail:
            yield ReasoningDelta(tail, choice)
        elif not splitter.stopped and not thinking and not one_call:
            for event in self._split(splitter.feed(tail) + splitter.flush(), calls, choice, pending):
                yield event
            finish = "stop" if splitter.stopped else finish
        if pending:
            yield TextDelta("", choice, tuple(pending))
        if calls is not None and calls.count and finish == "stop":
            finish = "tool_calls"
        yield Finished(finish, len(ids), choice, tuple(ids), splitter.matched)  # type: ignore[arg-type]

    @staticmethod
    def _split(parts: list[tuple[str, str]], calls: CallStream | None, choice: int,
               pending: list[TokenLogprob]) -> list[Event]:
        """Events of a :class:`TextSplitter` result: its text, and its call parts through
        ``calls``; the first text delta carries the ``pending`` log-probabilities."""
        out: list[Event] = []
        for kind, text in parts:
            events = [TextDelta(text, choice)] if kind == "text" or calls is None else calls.take(kind, text)
            for event in events:
                if isinstance(event, TextDelta):
                    if not (event.text or pending):
                        continue
                    event = replace(event, logprobs=tuple(pending))
                    pending.clear()
                out.append(event)
        return out

    @staticmethod
    def _with_ids(events: list[Event], choice: int, ids: list[int], pending: list[TokenLogprob]) -> list[Event]:
        """``events`` with ``ids`` on their first text delta (a new empty one when none)."""
        for k, event in enumerate(events):
            if isinstance(event, TextDelta):
                events[k] = replace(event, token_ids=tuple(ids))
                return events
        pending_lp, pending[:] = tuple(pending), []
        return [*events, TextDelta("", choice, pending_lp, tuple(ids))]

    def _logprob(self, token) -> TokenLogprob:
        text = self.tokenizer.decode([int(token)])
        top = tuple((self.tokenizer.decode([i]), i, v) for i, v in token.top)
        return TokenLogprob(text, int(token), float(token.logprob), top)
