"""Ollama's API on the node's port (what Open WebUI, Continue, Copilot's Ollama provider
and the ``ollama`` client libraries speak): ``POST /api/chat`` and ``/api/generate`` as
adapters over the internal request and event stream, ``GET /api/tags``, ``GET /api/ps``,
``POST /api/show``, ``GET /api/version``, and a clear refusal for embeddings and model
management, which a ringlet cluster does not serve.

Replies stream as newline-delimited JSON (``application/x-ndjson``; Ollama streams unless
the body says ``"stream": false``, which gives one JSON object). Each chunk carries the
new text (``message.content`` or ``response``), thinking (``thinking``), or the complete
tool calls (``message.tool_calls[].function.{name, arguments}``, arguments an object);
the last has ``done: true``, ``done_reason`` (``stop`` or ``length``) and Ollama's
figures, durations in nanoseconds: ``total_duration`` (from the request's arrival),
``load_duration`` (admission: the tokenizer's first build, the prompt's rendering),
``prompt_eval_count`` (prompt tokens), ``prompt_eval_duration`` (until the first output),
``eval_count`` (generated tokens), ``eval_duration`` (from the first output to the end).
A non-raw ``/api/generate`` also returns ``context``: the prompt's and the answer's token
ids, which a next request may send back. Errors are ``{"error": "..."}`` with the HTTP
status (400 a bad field, 404 another model); an error after the stream began is a last
``{"error": ...}`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ringlet.daemon.api.anthropic_schema import tool_input
from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.fields import Ignored
from ringlet.daemon.api.ollama_models import ModelFacts, model_facts, served_name, show_json, timestamp
from ringlet.daemon.api.ollama_schema import ChatRequest, GenerateRequest, ShowRequest
from ringlet.daemon.api.openai_api import SSE_HEADERS
from ringlet.daemon.api.pipeline import OUTPUTS, Pipeline, Prepared
from ringlet.daemon.api.request import Finished, ReasoningDelta, Started, TextDelta, TokenLogprob, ToolCall, Usage
from ringlet.daemon.api.ticker import until_gone
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.limits import is_ollama

#: the Ollama release whose API (docs/api.md, api/types.go) this surface follows; clients
#: that check ``/api/version`` for a minimum (Copilot's provider) compare with it
OLLAMA_VERSION = "0.32.15"
#: Ollama's paths for what ringlet does not serve, and why
NOT_SERVED = {
    "/api/embed": "embeddings are not served here: ringlet serves no embedding model (this cluster serves the "
                  "generative model {model}); point embedding requests at a server with an embedding model",
    "/api/embeddings": "embeddings are not served here: ringlet serves no embedding model (this cluster serves "
                       "the generative model {model}); point embedding requests at a server with an embedding model",
}
#: model management: a cluster serves the model it was started with
MANAGEMENT = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")


def done_reason(finished: Finished | None) -> str:
    """Ollama's ``done_reason``: ``length`` at the token cap, else ``stop`` (tool calls too)."""
    return "length" if finished is not None and finished.reason == "length" else "stop"


def logprobs_json(items: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """Ollama's ``logprobs``: per token ``token``, ``logprob``, ``bytes``, ``top_logprobs``."""
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(t.token, t.logprob), "top_logprobs": [entry(s, v) for s, _, v in t.top]} for t in items]


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """One call in ``message.tool_calls``: ``id`` (a tool result may name it in
    ``tool_call_id``) and ``function.{index, name, arguments}``, arguments an object."""
    return {"id": call.id,
            "function": {"index": call.index, "name": call.name, "arguments": tool_input(call.arguments)}}


class _Reply:
    """One chat or generate reply built from the event stream: its chunks while streaming,
    the whole object at the end.

    Args:
        kind: ``chat`` or ``generate``.
        model: the model as the request named it (Ollama echoes it).
        arrived: ``time.perf_counter_ns()`` when the request arrived.
        admitted: the same, once it was admitted (tokenizer ready, prompt rendered).
        context: return ``context`` (a non-raw generate).
    """

    def __init__(self, kind: str, model: str, arrived: int, admitted: int, context: bool) -> None:
        self.kind, self.model, self.arrived, self.admitted, self.context = kind, model, arrived, admitted, context
        self.first: int | None = None  # the first output's time
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.prompt_ids: tuple[int, ...] = ()
        self.finished: Finished | None = None

    def _chunk(self, text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        if logprobs:
            out["logprobs"] = logprobs
        return out

    def add(self, event) -> dict[str, Any] | None:
        """The stream chunk ``event`` makes (``None``: none), recording it for :meth:`whole`."""
        if isinstance(event, OUTPUTS) and self.first is None:
            self.first = time.perf_counter_ns()
        if isinstance(event, Started):
            self.prompt_ids = event.prompt_ids
        elif isinstance(event, TextDelta) and (event.text or event.logprobs):
            self.text.append(event.text)
            lp = logprobs_json(event.logprobs)
            self.logprobs += lp
            return self._chunk(text=event.text, logprobs=lp)
        elif isinstance(event, ReasoningDelta) and event.text:
            self.thinking.append(event.text)
            return self._chunk(thinking=event.text)
        elif isinstance(event, ToolCall):
            call = tool_call_json(event)
            self.calls.append(call)
            return self._chunk(calls=[call])
        elif isinstance(event, Finished):
            self.finished = event
        elif isinstance(event, Usage):
            return self.last(event, streamed=True)
        return None

    def last(self, usage: Usage, streamed: bool) -> dict[str, Any]:
        """The final object: the whole reply (``streamed`` false) or an empty last chunk,
        with ``done``, ``done_reason`` and the figures."""
        now = time.perf_counter_ns()
        first = self.first or now
        if streamed:
            out = self._chunk()
        else:
            out = self._chunk("".join(self.text), "".join(self.thinking), self.calls, self.logprobs)
        out.update(done=True, done_reason=done_reason(self.finished), total_duration=now - self.arrived,
                   load_duration=self.admitted - self.arrived, prompt_eval_count=usage.prompt_tokens,
                   prompt_eval_duration=first - self.admitted, eval_count=usage.completion_tokens,
                   eval_duration=now - first)
        if self.context:
            ids = list(self.finished.token_ids) if self.finished is not None else []
            if ids and self.finished.reason != "length" and self.finished.stop_string is None:
                ids = ids[:-1]  # the end token is not part of the conversation's text
            out["context"] = [*self.prompt_ids, *ids]
        return out


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj) + "\n"


async def _stream(reply: _Reply, events: AsyncIterator, request: Request) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if (chunk := reply.add(event)) is not None:
                    yield _line(chunk)
                if await request.is_disconnected():
                    return  # closing the generators releases the KV caches on every stage
    except GenerationError as exc:
        yield _line({"error": f"generation failed: {exc}"})


async def _whole(reply: _Reply, events: AsyncIterator) -> dict[str, Any]:
    usage = Usage(0, 0)
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, Usage):
                usage = event
            else:
                reply.add(event)
    return reply.last(usage, streamed=False)


class JsonBodies:
    """ASGI middleware: a ``POST`` to Ollama's paths is read as JSON whatever its
    ``Content-Type`` says, as Ollama reads it (``curl -d``, as Ollama's documentation uses
    it, sends a form's type)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("method") == "POST" and is_ollama(scope.get("path", "")):
            headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def register(app: FastAPI, pipeline: Pipeline) -> None:
    """Add Ollama's endpoints to ``app`` (and :class:`JsonBodies` in front of it)."""
    app.add_middleware(JsonBodies)
    node = pipeline.node
    facts: list[ModelFacts] = []  # read once, on first use

    async def model() -> ModelFacts:
        if not facts:
            facts.append(await asyncio.to_thread(model_facts, node.config.model, pipeline.context_tokens))
        return facts[0]

    async def admit(body: ChatRequest | GenerateRequest, request: Request) -> Prepared:
        try:
            prepared = await pipeline.admit(served_name(body.model, pipeline.model_name), body.internal,
                                            app.state.cache_scope(request))
        except ApiError as exc:  # the internal name of format
            if exc.param == "response_format":
                exc.message, exc.param = exc.message.replace("response_format", "format"), "format"
            raise
        if body.think and not getattr(pipeline.tokenizer, "has_thinking", False):
            raise ApiError(400, f'"{body.model}" does not support thinking', param="think")
        return prepared

    async def respond(kind: str, body: ChatRequest | GenerateRequest, request: Request, loading: bool):
        arrived = time.perf_counter_ns()
        if loading:  # Ollama: no prompt (no messages) loads the model; keep_alive 0 unloads it
            served_name(body.model, pipeline.model_name)
            reply = _Reply(kind, body.model, arrived, arrived, False)._chunk()
            reply.update(done=True, done_reason="unload" if body.keep_alive in (0, "0", "0s") else "load")
            return JSONResponse(reply, headers=Ignored("ollama", ["keep_alive"] if body.keep_alive is not None
                                                       else []).headers())
        prepared = await admit(body, request)
        hints = Ignored(f"ollama.{kind}", prepared.request.ignored).headers()
        reply = _Reply(kind, body.model, arrived, time.perf_counter_ns(),
                       kind == "generate" and prepared.request.messages is not None)
        events = pipeline.run(prepared)
        if not body.streaming:
            try:
                return JSONResponse(await _whole(reply, until_gone(events, request)), headers=hints)
            except GenerationError as exc:
                raise ApiError(503, f"generation failed: {exc}") from None
        return StreamingResponse(_stream(reply, events, request), media_type="application/x-ndjson",
                                 headers={**SSE_HEADERS, **hints})

    @app.post("/api/chat")
    async def chat(body: ChatRequest, request: Request):
        return await respond("chat", body, request, loading=not body.messages)

    @app.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request):
        return await respond("generate", body, request, loading=not body.prompt)

    @app.get("/api/tags")
    async def tags():
        return {"models": [(await model()).tag()]}

    @app.get("/api/ps")
    async def ps():
        serving = node.state in ("ready", "serving")
        return {"models": [(await model()).running(pipeline.context_tokens)] if serving else []}

    @app.post("/api/show")
    async def show(body: ShowRequest):
        if not (body.model or body.name):
            raise ApiError(400, "model is required", param="model")
        served_name(body.model or body.name, pipeline.model_name)
        await pipeline.ready()
        tok = pipeline.tokenizer
        capabilities = ["completion", "tools"] + (["thinking"] if getattr(tok, "has_thinking", False) else [])
        template = getattr(tok, "chat_template", None)
        return show_json(await model(), capabilities, template if isinstance(template, str) else "")

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION, "ringlet": versions.RELEASE}

    for path, answer in (("/api/tags", tags), ("/api/version", version)):  # Ollama answers HEAD there too
        app.add_api_route(path, answer, methods=["HEAD"], include_in_schema=False)

    async def not_served(request: Request):
        why = NOT_SERVED.get(request.url.path) or (
            "model management is not served here: a ringlet cluster serves the model it was started with "
            "({model}); start the daemons with --model to serve another")
        raise ApiError(501, why.format(model=repr(pipeline.model_name)))

    for path in (*NOT_SERVED, *MANAGEMENT):
        app.add_api_route(path, not_served, methods=["POST", "DELETE"], include_in_schema=False)
