"""OpenAI's Responses API, ``POST /v1/responses``: an adapter from its body
(:mod:`ringlet.daemon.api.responses_schema`) to the internal request, and from the
event stream back to a ``response`` object or its server-sent events
(``event: <type>`` / ``data: <json>``, each numbered by ``sequence_number``).

The output items follow the events in order: a ``reasoning`` item for thinking text, a
``message`` item (one ``output_text`` part) for visible text, a ``function_call`` item
per tool call (its arguments streamed as the model writes them). A response cut by
``max_output_tokens`` is ``incomplete`` (reason ``max_output_tokens``), and so is the
item being written when it was cut. Stateless: nothing is stored, so there is no
``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.fields import Ignored
from ringlet.daemon.api.openai_api import SSE_HEADERS
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.request import (
    CUSTOM_INPUT,
    Event,
    Finished,
    GenerationRequest,
    Keepalive,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    Usage,
)
from ringlet.daemon.api.responses_schema import ResponsesRequest
from ringlet.daemon.api.seal import Sealer
from ringlet.daemon.api.ticker import until_gone
from ringlet.daemon.errors import GenerationError


def new_id(prefix: str) -> str:
    """A fresh object id, ``<prefix>_<32 hex digits>`` (``resp``, ``msg``, ``fc``, ``rs``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def frame(event: dict[str, Any]) -> str:
    """One server-sent event: its ``type`` as the event name, itself as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """The Responses API's ``usage`` object (reasoning tokens are not counted apart)."""
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def echo_fields(body: ResponsesRequest, internal: GenerationRequest) -> dict[str, Any]:
    """The request settings a ``response`` object repeats (with their effective values)."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    tools = [dict(d) for d in body.tools or ()]
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": internal.parallel_tool_calls,
            "previous_response_id": None, "reasoning": body.reasoning, "temperature": internal.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto", "tools": tools,
            "top_p": internal.top_p, "truncation": "disabled", "user": body.user, "background": False}


def response_json(head: dict[str, Any], echo: dict[str, Any], status: str, items: list[dict[str, Any]],
                  usage: Usage | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``response`` object: ``status`` ``in_progress``, ``completed``, ``incomplete`` or ``failed``."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    done = int(time.time()) if status in ("completed", "incomplete") else None
    return {**head, "status": status, "error": error, "incomplete_details": incomplete, "output": items,
            "usage": usage_json(usage), "completed_at": done, **echo}


class OutputBuilder:
    """The output items of one response, built from the pipeline's events, and the
    stream events announcing each step (numbered from 0 by :meth:`event`).

    Whitespace-only text before a message starts is held back: it joins the message
    when visible text follows, and is dropped when a function call follows.

    Args:
        tools: the request's tools: a call to a namespace's function goes back with its
            ``namespace``, a call to a custom tool as a ``custom_tool_call``.
        seal: with it, each reasoning item carries its text sealed in
            ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``).
    """

    def __init__(self, tools: list[Tool] | None = None, seal: Sealer | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._space = ""
        self.tools = {t.name: t for t in tools or ()}
        self.seal = seal
        self._calls: dict[int, int] = {}  # a call's index -> its output index

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event of type ``kind``, with the next ``sequence_number``."""
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """The stream events of one pipeline event (text, reasoning or a tool call's step)."""
        if isinstance(event, ReasoningDelta):
            return self._delta("reasoning", event.text)
        if isinstance(event, TextDelta):
            return self._delta("message", event.text)
        if isinstance(event, ToolCallStart):
            return self._call_start(event)
        if isinstance(event, ToolCallDelta):
            return self._call_delta(event)
        if isinstance(event, ToolCall):
            return self._call_done(event)
        return []

    def finish(self, reason: str) -> list[dict[str, Any]]:
        """Close the output after :class:`Finished` with ``reason``; a response with no
        message and no call gets a (possibly empty) message."""
        status = "incomplete" if reason == "length" else "completed"
        out: list[dict[str, Any]] = []
        if not any(item["type"] in ("message", "function_call", "custom_tool_call") for item in self.items):
            space, self._space = self._space, ""
            out += self.close() + self._start("message") + self._delta("message", space)
        self._space = ""
        return out + self.close(status)

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the item being written (if any) with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = len(self.items) - 1, item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **where, text=part["text"])
            if self.seal is not None:
                item["encrypted_content"] = self.seal.seal("reasoning", part["text"])
        return [done, self.event("response.content_part.done", **where, part=copy.deepcopy(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        index = len(self.items)
        self.items.append(item)
        self._open = item
        out = [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]
        item["content"].append(part)
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=copy.deepcopy(part)))
        return out

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message" and not text.strip():
                self._space += text
                return []
            out += self.close() + self._start(kind)
        if kind == "message":
            text, self._space = self._space + text, ""
        item = self._open
        if item is None:  # never: the item was just started
            return out
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            out.append(self.event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            out.append(self.event("response.reasoning_text.delta", **where, delta=text))
        return out

    def _call_start(self, call: ToolCallStart) -> list[dict[str, Any]]:
        out = self.close()
        self._space = ""
        tool = self.tools.get(call.name)
        if tool is not None and tool.custom:
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "call_id": call.id, "name": tool.client_name,
                    "input": "", "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            if tool is not None and tool.namespace:
                item["name"], item["namespace"] = tool.client_name, tool.namespace
        self._calls[call.index] = index = len(self.items)
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item)))
        return out

    def _call_delta(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        index = self._calls[call.index]
        item = self.items[index]
        if not call.arguments or item["type"] == "custom_tool_call":  # a custom input goes whole, at its end
            return []
        item["arguments"] += call.arguments
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=call.arguments)]

    def _call_done(self, call: ToolCall) -> list[dict[str, Any]]:
        index = self._calls[call.index]
        item = self.items[index]
        where = {"item_id": item["id"], "output_index": index}
        item["status"] = "incomplete" if call.cut else "completed"
        if item["type"] == "custom_tool_call":
            item["input"] = custom_input(call.arguments)
            return [self.event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                    self.event("response.custom_tool_call_input.done", **where, input=item["input"]),
                    self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]
        item["arguments"] = call.arguments
        return [self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


def custom_input(arguments: str) -> str:
    """A custom tool call's input: the text the model passed as its one argument
    ``input`` (the whole arguments text when they are not such an object)."""
    try:
        value = json.loads(arguments).get(CUSTOM_INPUT, "")
    except (json.JSONDecodeError, AttributeError):
        return arguments
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def register(app: FastAPI, pipeline: Pipeline) -> None:
    """Add ``POST /v1/responses`` to ``app``."""

    seal: Sealer | None = getattr(app.state, "sealer", None)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        prepared = await pipeline.admit(body.model, lambda: body.internal(seal), app.state.cache_scope(request))
        internal = prepared.request
        hints = Ignored("responses", internal.ignored).headers()
        head = {"id": new_id("resp"), "object": "response", "created_at": int(time.time()),
                "model": pipeline.model_name}
        echo = echo_fields(body, internal)
        events = pipeline.run(prepared)
        out = OutputBuilder(internal.tools, seal if body.sealed_reasoning() else None)
        if not body.stream:
            try:
                return JSONResponse(await _whole(until_gone(events, request), head, echo, out), headers=hints)
            except GenerationError as exc:
                raise ApiError(503, f"generation failed: {exc}") from None
        return StreamingResponse(_stream(events, head, echo, request, out), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **hints})


async def _whole(events: AsyncIterator[Event], head: dict[str, Any], echo: dict[str, Any],
                 out: OutputBuilder) -> dict[str, Any]:
    status, usage = "completed", None
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, Finished):
                out.finish(event.reason)
                status = "incomplete" if event.reason == "length" else "completed"
            elif isinstance(event, Usage):
                usage = event
            else:
                out.feed(event)
    return response_json(head, echo, status, out.items, usage)


async def _stream(events: AsyncIterator[Event], head: dict[str, Any], echo: dict[str, Any],
                  request: Request, out: OutputBuilder) -> AsyncIterator[str]:
    for kind in ("response.created", "response.in_progress"):
        yield frame(out.event(kind, response=response_json(head, echo, "in_progress", [], None)))
    status, usage = "completed", None
    try:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, Finished):
                    frames = out.finish(event.reason)
                    status = "incomplete" if event.reason == "length" else "completed"
                elif isinstance(event, Usage):
                    usage, frames = event, []
                elif isinstance(event, Keepalive):
                    frames = [out.event("response.in_progress",
                                        response=response_json(head, echo, "in_progress", out.items, None))]
                else:
                    frames = out.feed(event)
                for item in frames:
                    yield frame(item)
                if await request.is_disconnected():
                    return  # closing the generators releases the KV caches on every stage
    except GenerationError as exc:
        for item in out.close("incomplete"):
            yield frame(item)
        error = {"code": "server_error", "message": f"generation failed: {exc}"}
        yield frame(out.event("response.failed", response=response_json(head, echo, "failed", out.items, None,
                                                                         error)))
        return
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield frame(out.event(kind, response=response_json(head, echo, status, out.items, usage)))
