"""OpenAI-compatible HTTP API (FastAPI), served by every node.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events ending with ``data: [DONE]``, or not), ``GET /v1/models``,
``GET /v1/cluster``, ``GET /healthz``. Bad requests get a 4xx JSON error in OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``); the node keeps serving.

Tokenization, the chat template and streaming detokenization are the model's own,
through mlx-lm's ``TokenizerWrapper``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.errors import GenerationError
from ringlet.daemon.node import Node
from ringlet.daemon.wire.limits import ApiLimits, install

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


def whole_characters(text: str) -> str:
    """``text`` without the replacement characters at its end: mlx-lm's detokenizer holds
    back bytes until they complete a UTF-8 character and, on ``finalize``, decodes an
    incomplete rest as U+FFFD. A reply cut there (by ``max_tokens``, or an end token
    after part of a character) ends with whole characters only, as OpenAI's API does;
    ``usage.completion_tokens`` still counts every token."""
    return text.rstrip("\ufffd")


class ApiError(Exception):
    """An error returned to the HTTP client with a status code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class _Common(BaseModel):
    # strict: a body of the wrong types ("1" for a bool, 1.5 for an int) is a 400, never coerced
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    return_token_ids: bool = False  # extension (as in vLLM): the completion's token ids

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        for s in items:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return items


class ChatRequest(_Common):
    """``POST /v1/chat/completions`` body (the subset ringlet honours; unknown fields ignored)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    prompt: str | list[int]
    echo: bool = False


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


class _StopMatcher:
    """Finds stop sequences in streamed text, holding back a possible partial match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add text; return what can be emitted now (never part of a stop sequence)."""
        self.text += piece
        cut = min((i for s in self.stops if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.emitted = self.text[self.emitted:cut], cut
            return out
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        if safe <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:safe], safe
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def create_app(node: Node, tokenizer, model_name: str, context_tokens: int,
               limits: ApiLimits | None = None) -> FastAPI:
    """Build the FastAPI app for a node.

    Args:
        node: the serving node.
        tokenizer: the model's mlx-lm ``TokenizerWrapper``.
        model_name: the id reported by ``/v1/models`` and in responses.
        context_tokens: the model's context length; prompts longer than it are rejected
            and ``max_tokens`` is clamped to what remains.
        limits: API key, body size, prompt and completion caps, concurrency (limits.py).
    """
    app = FastAPI(title="ringlet", version="0.1.0", description="OpenAI-compatible API of a ringlet node")
    limits = limits or ApiLimits()
    install(app, limits)  # API key on /v1/*, body size, concurrency + queue (429); see limits.py
    eos_ids = frozenset(tokenizer.eos_token_ids)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"invalid request: {loc or 'body'}: {first.get('msg', 'malformed body')}", param=loc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "state": node.state, "node_id": node.node_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ringlet"}]}

    @app.get("/v1/cluster")
    async def cluster():
        admission = app.state.admission
        return {**node.info(), "api": {"running": admission.running, "queued": admission.waiting,
                                       "max_concurrent_requests": admission.max_running,
                                       "max_queue": admission.max_waiting}}

    def _check_model(body: _Common) -> None:
        if body.model not in (None, "", model_name):
            raise ApiError(404, f"model {body.model!r} is not served here; this cluster serves {model_name!r}",
                           param="model", code="model_not_found")

    def _budget(prompt_len: int, body: _Common) -> int:
        if prompt_len >= context_tokens:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; the model's context is {context_tokens}",
                           param="messages", code="context_length_exceeded")
        if (too_long := limits.prompt_error(prompt_len)) is not None:
            raise ApiError(400, too_long, param="messages", code="context_length_exceeded")
        wanted = body.max_completion_tokens or body.max_tokens or (context_tokens - prompt_len)
        return limits.clamp_completion(min(wanted, context_tokens - prompt_len))

    def _sampling(body: _Common) -> SamplingParams:
        # top_k >= vocabulary keeps every token (= off); mlx-lm raises on it, and that error
        # inside its compiled sampler breaks MLX's random state for every later request.
        # A seed outside uint64 (the wire type) is reduced into it.
        top_k = body.top_k if body.top_k < len(tokenizer) else 0
        seed = None if body.seed is None else body.seed % 2**64
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=top_k, seed=seed)

    def _cache_scope(request: Request | None) -> str:
        """The prefix cache scope of a request: its API key's digest when the node checks
        keys and scopes entries per key (``--prefix-cache-scope key``), else the cluster's."""
        if request is None or not limits.api_key_digests or node.config.prefix_cache_scope != "key":
            return ""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        raw = key.strip().encode("utf-8", "surrogateescape")
        return hashlib.sha256(b"ringlet prefix scope\0" + raw).hexdigest()[:32]

    async def _run(prompt_ids: list[int], body: _Common, ids: list[int] | None = None,
                   request: Request | None = None, info: dict | None = None,
                   ) -> AsyncIterator[tuple[str, str | None, int]]:
        """Yield ``(text delta, finish_reason or None, completion tokens so far)``; token
        ids are appended to ``ids`` when given; ``info["cached_tokens"]`` gets the prompt
        tokens the prefix cache served."""
        max_tokens = _budget(len(prompt_ids), body)
        detok = tokenizer.detokenizer
        matcher = _StopMatcher(body.stop or [])
        count = 0
        finish = "length"
        generation = node.generate(prompt_ids, max_tokens, _sampling(body), eos_ids,
                                   cache_scope=_cache_scope(request), info=info)
        async with contextlib.aclosing(generation) as tokens:
            async for token in tokens:
                count += 1
                if ids is not None:
                    ids.append(token)
                if token in eos_ids:
                    finish = "stop"
                    break
                before = len(detok.text)
                detok.add_token(token)
                delta = matcher.feed(detok.text[before:])
                if matcher.stopped:
                    yield delta, "stop", count
                    return
                if delta:
                    yield delta, None, count
        detok.finalize()
        final = whole_characters(detok.text)
        tail = matcher.feed(final[len(matcher.text):]) if len(final) > len(matcher.text) else ""
        if matcher.stopped:
            yield tail, "stop", count
            return
        yield tail + matcher.flush(), finish, count

    def _chat_prompt(body: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as exc:  # the template raises jinja2 errors of many kinds
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    def _completion_prompt(body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, list):
            vocab = len(tokenizer)
            if not body.prompt or any(t < 0 or t >= vocab for t in body.prompt):
                raise ApiError(400, f"prompt token ids must be a non-empty list within [0, {vocab})", param="prompt")
            return list(body.prompt)
        ids = tokenizer.encode(body.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    async def _respond(kind: str, body: _Common, prompt_ids: list[int], request: Request | None = None):
        _check_model(body)
        _budget(len(prompt_ids), body)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        info: dict = {}

        def usage_of(count: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": count,
                    "total_tokens": len(prompt_ids) + count,
                    "prompt_tokens_details": {"cached_tokens": int(info.get("cached_tokens", 0))}}

        if not body.stream:
            text, finish, count, ids = [], "length", 0, []
            try:
                async for delta, reason, so_far in _run(prompt_ids, body, ids, request, info):
                    count = so_far
                    text.append(delta)
                    if reason:
                        finish = reason
            except GenerationError as exc:
                raise ApiError(503, f"generation failed: {exc}") from None
            content = "".join(text)
            usage = usage_of(count)
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": content},
                          "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = ids
            return {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": [choice], "usage": usage}

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(delta: str | None, finish: str | None, first: bool = False, token_ids: list[int] | None = None
                  ) -> str:
            if kind == "chat":
                d: dict[str, Any] = {}
                if first:
                    d["role"] = "assistant"
                if delta:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
                payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model_name, "choices": [choice]}
            else:
                payload = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                           "choices": [{"index": 0, "text": delta or "", "finish_reason": finish,
                                        "logprobs": None}]}
            if token_ids is not None:
                payload["choices"][0]["token_ids"] = token_ids
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            count, ids, sent = 0, [], 0
            yield chunk("", None, first=True)
            try:
                async with contextlib.aclosing(_run(prompt_ids, body, ids, request, info)) as pieces:
                    async for delta, reason, so_far in pieces:
                        count = so_far
                        if delta or reason:
                            new_ids = ids[sent:] if body.return_token_ids else None
                            sent = len(ids)
                            yield chunk(delta, reason, token_ids=new_ids)
                        if request is not None and await request.is_disconnected():
                            return  # closing the generators releases the KV caches on every stage
            except GenerationError as exc:
                err = {"error": {"message": f"generation failed: {exc}", "type": "server_error",
                                 "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
            if include_usage:
                usage = usage_of(count)
                yield ("data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if kind == "chat"
                                              else "text_completion", "created": created, "model": model_name,
                                              "choices": [], "usage": usage}) + "\n\n")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body)
        return await _respond("chat", body, _chat_prompt(body), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body)
        return await _respond("completion", body, _completion_prompt(body), request)

    return app
