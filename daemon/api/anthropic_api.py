"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(what Claude Code and the ``anthropic`` SDK speak): an adapter from its body
(:mod:`ringlet.daemon.api.anthropic_schema`) to the internal request, and from the event
stream back to a ``message`` object or the streamed events ``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``.

Content blocks come in the order the model wrote them: ``thinking``, ``text``,
``tool_use``. ``usage.input_tokens`` counts the prompt tokens the prefix cache did not
serve and ``cache_read_input_tokens`` those it did, as Anthropic counts them.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ringlet.daemon.api.anthropic_schema import CountTokensRequest, MessagesRequest, tool_input
from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.fields import Ignored
from ringlet.daemon.api.openai_api import SSE_HEADERS
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.request import (
    Finished,
    Keepalive,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from ringlet.daemon.api.seal import Sealer
from ringlet.daemon.api.ticker import until_gone
from ringlet.daemon.errors import GenerationError


def stop_reason(finished: Finished) -> str:
    """Anthropic's ``stop_reason`` of a finished choice."""
    if finished.reason == "tool_calls":
        return "tool_use"
    if finished.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finished.stop_string is not None else "end_turn"


def usage_json(usage: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    """Anthropic's ``usage`` (before the end, ``usage`` ``None``: no output yet)."""
    cached = usage.cached_tokens if usage is not None else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": usage.completion_tokens if usage else 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def frame(event: dict[str, Any]) -> str:
    """One server-sent event: its ``type`` as the event name, itself as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class _Blocks:
    """Content blocks built from the events, for the whole message and the stream alike.

    Args:
        seal: seals each thinking block's text into its ``signature``.
        omit_thinking: ``thinking.display`` ``"omitted"``: thinking blocks carry no
            text (only the signature, which still seals it).
    """

    def __init__(self, seal: Sealer | None = None, omit_thinking: bool = False) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # type of the block being written
        self.seal, self.omit_thinking = seal, omit_thinking
        self._thought = ""  # the open thinking block's whole text

    def add(self, event) -> list[dict[str, Any]]:
        """The stream events one pipeline event makes (and the blocks updated)."""
        out: list[dict[str, Any]] = []
        if isinstance(event, TextDelta) and event.text:
            out += self._start("text", {"type": "text", "text": ""})
            self.blocks[-1]["text"] += event.text
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ReasoningDelta) and event.text:
            out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thought += event.text
            if not self.omit_thinking:
                self.blocks[-1]["thinking"] += event.text
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, ToolCallStart):  # the tool_use block opens with an empty input
            out += self._close()
            block = {"type": "tool_use", "id": "toolu_" + event.id.removeprefix("call_"), "name": event.name,
                     "input": {}}
            out.append({"type": "content_block_start", "index": len(self.blocks), "content_block": dict(block)})
            self.blocks.append(block)
            self.open = "tool_use"
        elif isinstance(event, ToolCallDelta) and event.arguments:  # the input's JSON as it is written
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
        elif isinstance(event, ToolCall):  # the block's input is the whole arguments object
            self.blocks[-1]["input"] = tool_input(event.arguments)
            out += self._close()
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.open == kind:
            return []
        out = self._close()
        out.append({"type": "content_block_start", "index": len(self.blocks), "content_block": dict(block)})
        self.blocks.append(block)
        self.open = kind
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            signature = self.seal.seal("thinking", self._thought) if self.seal is not None else ""
            self.blocks[-1]["signature"], self._thought = signature, ""
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
        out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self.open = None
        return out


def register(app: FastAPI, pipeline: Pipeline) -> None:
    """Add the two endpoints to ``app``."""

    seal: Sealer | None = getattr(app.state, "sealer", None)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        scope = app.state.cache_scope(request)
        try:
            prepared = await pipeline.admit(body.model, lambda: body.request(seal), scope)
        except ApiError as exc:  # the internal name of output_config.format
            if exc.param == "response_format":
                exc.message, exc.param = exc.message.replace("response_format", "output_config.format"), \
                    "output_config.format"
            raise
        hints = Ignored("messages", prepared.request.ignored +
                        (["anthropic-beta"] if "anthropic-beta" in request.headers else [])).headers()
        head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                "model": body.model or pipeline.model_name}
        events = pipeline.run(prepared)
        blocks = _Blocks(seal, body.thinking is not None and body.thinking.display == "omitted")
        if not body.stream:
            try:
                return JSONResponse(await _whole(until_gone(events, request), head, blocks), headers=hints)
            except GenerationError as exc:
                raise ApiError(503, f"generation failed: {exc}") from None
        return StreamingResponse(_stream(events, head, request, blocks), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **hints})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        pipeline.check_model(body.model)
        request = body.internal(seal)
        await pipeline.ready()
        ids, _ = pipeline.prompt_ids(request)
        return {"input_tokens": len(ids)}


async def _whole(events: AsyncIterator, head: dict[str, Any], blocks: _Blocks) -> dict[str, Any]:
    finished, usage, prompt = None, None, 0
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, Started):
                prompt = event.prompt_tokens
            elif isinstance(event, Finished):
                finished = event
            elif isinstance(event, Usage):
                usage = event
            else:
                blocks.add(event)
    blocks._close()  # seals a thinking block that ended the message
    return {**head, "content": blocks.blocks, "stop_reason": stop_reason(finished),
            "stop_sequence": finished.stop_string, "usage": usage_json(usage, prompt)}


async def _stream(events: AsyncIterator, head: dict[str, Any], request: Request,
                  blocks: _Blocks) -> AsyncIterator[str]:
    finished, prompt = None, 0
    try:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, Started):
                    prompt = event.prompt_tokens
                    yield frame({"type": "message_start", "message": {
                        **head, "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": usage_json(None, prompt)}})
                    yield frame({"type": "ping"})
                elif isinstance(event, Keepalive):
                    yield frame({"type": "ping"})
                elif isinstance(event, Finished):
                    finished = event
                elif isinstance(event, Usage):
                    for out in blocks._close():
                        yield frame(out)
                    yield frame({"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason(finished), "stop_sequence": finished.stop_string},
                                 "usage": usage_json(event, prompt)})
                    yield frame({"type": "message_stop"})
                else:
                    for out in blocks.add(event):
                        yield frame(out)
                if await request.is_disconnected():
                    return  # closing the generators releases the KV caches on every stage
    except GenerationError as exc:
        yield frame({"type": "error", "error": {"type": "api_error", "message": f"generation failed: {exc}"}})
