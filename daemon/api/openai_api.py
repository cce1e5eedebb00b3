"""OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions``: an adapter from
their bodies to the internal request and from the event stream back to their JSON and
server-sent events (ending with ``data: [DONE]``)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.fields import Ignored
from ringlet.daemon.api.openai_schema import ChatRequest, CompletionRequest
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.request import (
    Finished,
    Keepalive,
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
from ringlet.daemon.api.ticker import until_gone
from ringlet.daemon.errors import GenerationError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: an SSE comment: keeps the connection (and proxies) alive, ignored by SSE parsers
KEEPALIVE = ": keepalive\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


def chat_logprobs(items: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """Chat completions' ``logprobs`` object for some tokens."""
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(s, v) for s, _, v in t.top]}
                        for t in items], "refusal": None}


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions' ``logprobs`` object; ``offset`` is the text offset of the first token."""
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{s: v for s, _, v in t.top} for t in items], "text_offset": offsets}


def usage_json(usage: Usage, kind: str = "chat") -> dict[str, Any]:
    """OpenAI's usage object; a chat completion's also has ``completion_tokens_details``
    with the drafted tokens accepted and rejected (speculative decoding)."""
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if kind == "chat":
        out["completion_tokens_details"] = {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                            "rejected_prediction_tokens": usage.rejected_prediction_tokens}
    return out


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A complete call in a chat ``message.tool_calls``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(event: ToolCallStart | ToolCallDelta) -> dict[str, Any]:
    """A call's piece in a streamed ``delta.tool_calls``, as OpenAI streams them: the
    first names the call (``id``, ``type``, ``function.name``, ``arguments: ""``), the
    next carry only ``index`` and a piece of ``function.arguments``."""
    if isinstance(event, ToolCallStart):
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    return {"index": event.index, "function": {"arguments": event.arguments}}


def register(app: FastAPI, pipeline: Pipeline) -> None:
    """Add the two endpoints to ``app``."""

    async def respond(kind: str, body: ChatRequest | CompletionRequest, request: Request, scope: str):
        prepared = await pipeline.admit(body.model, body.internal, scope)
        internal = prepared.request
        hints = Ignored("chat.completions" if kind == "chat" else "completions", internal.ignored).headers()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "created": created, "model": pipeline.model_name}
        events = pipeline.run(prepared)
        if not body.stream:
            try:
                return JSONResponse(await _whole(kind, internal, until_gone(events, request), head), headers=hints)
            except GenerationError as exc:
                raise ApiError(503, f"generation failed: {exc}") from None
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(kind, internal, events, head, include_usage, request),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **hints})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await respond("chat", body, request, app.state.cache_scope(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond("completion", body, request, app.state.cache_scope(request))


async def _whole(kind: str, internal, events: AsyncIterator, head: dict[str, Any]) -> dict[str, Any]:
    n = internal.n
    text = [[] for _ in range(n)]
    reasoning = [[] for _ in range(n)]
    calls: list[list[ToolCall]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finished: dict[int, Finished] = {}
    usage = None
    prompt_text, prompt_ids = "", ()
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, Started):
                prompt_text, prompt_ids = event.prompt_text, event.prompt_ids
            elif isinstance(event, TextDelta):
                text[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
            elif isinstance(event, ReasoningDelta):
                reasoning[event.choice].append(event.text)
            elif isinstance(event, ToolCall):
                calls[event.choice].append(event)
            elif isinstance(event, Finished):
                finished[event.choice] = event
            elif isinstance(event, Usage):
                usage = event
    choices = []
    for i in range(n):
        content = "".join(text[i])
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls[i] else ""),
                                       "refusal": None}
            if reasoning[i]:
                message["reasoning_content"] = "".join(reasoning[i])
            if calls[i]:
                message["tool_calls"] = [tool_call_json(c) for c in calls[i]]
            choice = {"index": i, "message": message, "finish_reason": finished[i].reason,
                      "logprobs": chat_logprobs(tuple(logprobs[i])) if internal.logprobs is not None else None}
        else:
            echo = prompt_text if internal.echo else ""
            choice = {"index": i, "text": echo + content, "finish_reason": finished[i].reason,
                      "logprobs": completion_logprobs(logprobs[i], len(echo))
                      if internal.logprobs is not None else None}
        if internal.return_token_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = list(finished[i].token_ids)
        choices.append(choice)
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {**head, "object": obj, "choices": choices, "usage": usage_json(usage, kind)}


async def _stream(kind: str, internal, events: AsyncIterator, head: dict[str, Any], include_usage: bool,
                  request: Request) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choice: int, delta: dict[str, Any] | str, finish: str | None = None, logprobs=None,
              extra: dict[str, Any] | None = None) -> str:
        if kind == "chat":
            body = {"index": choice, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            body = {"index": choice, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        return sse({**head, "object": obj, "choices": [{**body, **(extra or {})}]})

    offsets = [0] * internal.n
    sent_ids = [0] * internal.n
    try:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, Started):
                    for i in range(internal.n):
                        if kind == "chat":
                            yield chunk(i, {"role": "assistant", "content": ""})
                        elif internal.echo:
                            yield chunk(i, event.prompt_text)
                            offsets[i] = len(event.prompt_text)
                    if kind != "chat" and not internal.echo:
                        yield KEEPALIVE  # the headers and a first line go out at admission
                elif isinstance(event, Keepalive):
                    yield KEEPALIVE
                elif isinstance(event, PromptProgress):
                    yield sse({**head, "object": obj, "choices": [], "prompt_progress": {
                        "total": event.total, "cache": event.cache, "processed": event.processed,
                        "time_ms": event.time_ms}})
                elif isinstance(event, TextDelta):
                    lp = None
                    if internal.logprobs is not None:
                        lp = chat_logprobs(event.logprobs) if kind == "chat" else \
                            completion_logprobs(list(event.logprobs), offsets[event.choice])
                    offsets[event.choice] += len(event.text)
                    extra = None
                    if internal.return_token_ids:
                        extra = {"token_ids": list(event.token_ids)}
                        sent_ids[event.choice] += len(event.token_ids)
                    if event.text or lp or extra:
                        yield chunk(event.choice, {"content": event.text} if kind == "chat" else event.text,
                                    logprobs=lp, extra=extra)
                elif isinstance(event, ReasoningDelta) and kind == "chat":
                    yield chunk(event.choice, {"reasoning_content": event.text})
                elif isinstance(event, ToolCallStart | ToolCallDelta) and kind == "chat":
                    yield chunk(event.choice, {"tool_calls": [tool_call_delta(event)]})
                elif isinstance(event, Finished):
                    extra = None
                    if internal.return_token_ids:
                        extra = {"token_ids": list(event.token_ids[sent_ids[event.choice]:])}
                        sent_ids[event.choice] = len(event.token_ids)
                    yield chunk(event.choice, {} if kind == "chat" else "", event.reason, extra=extra)
                elif isinstance(event, Usage) and include_usage:
                    yield sse({**head, "object": obj, "choices": [], "usage": usage_json(event, kind)})
                if await request.is_disconnected():
                    return  # closing the generators releases the KV caches on every stage
    except GenerationError as exc:
        yield sse({"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                             "code": None}})
    yield "data: [DONE]\n\n"
