"""Limits on what callers may ask of a node: rates, concurrency, sizes, and the API key.

* :class:`RateLimiter` — per-key token buckets (the gRPC plane uses it for the
  per-peer rate of control RPCs; see transport.py).
* :class:`ConcurrencyLimiter` — at most N requests run, at most Q wait; beyond
  that, :class:`Overloaded` with a suggested retry delay.
* :class:`ApiLimits` and :class:`ApiGuard` — the HTTP API's guard, an ASGI
  middleware in front of the FastAPI app: API key on ``/v1/*``, Ollama's ``/api/*`` and
  ``/metrics`` (``/healthz`` stays open), body size (413), concurrency with a queue (429 + ``Retry-After``).
  Prompt size and ``max_tokens`` are checked by the API itself with
  :meth:`ApiLimits.prompt_error` and :meth:`ApiLimits.clamp_completion`, as only
  it knows the token count.

Every rejection has OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``) so the official clients raise the matching exceptions
(401 -> ``AuthenticationError``, 429 -> ``RateLimitError``); on Ollama's paths, Ollama's
``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ringlet.daemon.wire.auth import check_api_key

#: Default largest HTTP request body, bytes (a 128k-token prompt as text or as ids fits).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 8
DEFAULT_MAX_QUEUE = 32


class Overloaded(Exception):
    """Too many requests running and waiting; retry after ``retry_after_s`` seconds."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"too many requests; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


# --------------------------------------------------------------------------- rate limiting


class RateLimiter:
    """Token buckets per key: ``rate_per_s`` sustained, ``burst`` at once.

    At most ``max_keys`` buckets are kept (least recently used dropped; a dropped
    key starts again with a full bucket). Not thread-safe: use from one event loop.
    """

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def acquire(self, key: str) -> float:
        """Take one token for ``key``. Returns 0.0 if allowed, else the seconds until a token is due."""
        now = self._clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


# --------------------------------------------------------------------------- concurrency


class ConcurrencyLimiter:
    """At most ``max_running`` holders at once and ``max_waiting`` in a FIFO queue.

    Use ``async with limiter.slot(): ...``; raises :class:`Overloaded` at once
    when the queue is full. A waiter cancelled while queued leaves the queue.
    """

    def __init__(self, max_running: int, max_waiting: int):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._avg_s = 1.0  # moving average of a request's duration, for Retry-After

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        """A whole number of seconds after which a slot is likely free (at least 1)."""
        backlog = (self.running + self.waiting + 1) / self.max_running
        return max(1, min(600, math.ceil(self._avg_s * backlog)))

    def slot(self) -> _Slot:
        return _Slot(self)

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise Overloaded(self.retry_after_s())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # the releaser counted us in `running` already
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._release(0.0, record=False)  # handed a slot, but gave up
            raise

    def _release(self, duration_s: float, record: bool = True) -> None:
        if record:
            self._avg_s = 0.8 * self._avg_s + 0.2 * duration_s
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)  # the slot passes to it; `running` is unchanged
                return
        self.running -= 1


class _Slot:
    def __init__(self, limiter: ConcurrencyLimiter):
        self._limiter = limiter
        self._t0 = 0.0

    async def __aenter__(self) -> None:
        await self._limiter._acquire()
        self._t0 = time.monotonic()

    async def __aexit__(self, *exc: object) -> None:
        self._limiter._release(time.monotonic() - self._t0)


# --------------------------------------------------------------------------- HTTP API


@dataclass(frozen=True)
class ApiLimits:
    """Limits and access control of a node's HTTP API.

    Attributes:
        api_key_digests: SHA-256 digests of the accepted API keys
            (:func:`ringlet.daemon.wire.auth.load_api_keys`); empty = no key needed.
        max_body_bytes: largest request body, bytes (413 beyond).
        max_prompt_tokens: largest prompt, tokens (400 beyond); ``None`` = the
            model's context minus one. Never above the context in effect.
        max_completion_tokens: ``max_tokens`` is clamped to this (and always to
            what the context leaves); ``None`` = the context only.
        max_concurrent_requests: generations run at once by this node's API.
        max_queue: requests waiting for a slot; beyond, 429 with ``Retry-After``.
    """

    api_key_digests: tuple[bytes, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_queue: int = DEFAULT_MAX_QUEUE

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("max_prompt_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be at least 0")

    def prompt_error(self, prompt_tokens: int) -> str | None:
        """Why a prompt of ``prompt_tokens`` tokens is refused by this limit, or ``None``."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return f"the prompt has {prompt_tokens} tokens; this node accepts at most {self.max_prompt_tokens}"
        return None

    def clamp_completion(self, max_tokens: int) -> int:
        """``max_tokens`` clamped to :attr:`max_completion_tokens`."""
        if self.max_completion_tokens is not None:
            return min(max_tokens, self.max_completion_tokens)
        return max_tokens


#: the paths of Ollama's API (``/api/*``): guarded as ``/v1/*``, their errors in Ollama's shape
OLLAMA_PREFIX = "/api/"


def is_ollama(path: str) -> bool:
    """Whether ``path`` is one of Ollama's API paths (``/api`` and below)."""
    return path == OLLAMA_PREFIX.rstrip("/") or path.startswith(OLLAMA_PREFIX)


def error_body(status: int, message: str, code: str | None = None, kind: str | None = None, path: str = "") -> bytes:
    """An OpenAI-shaped error body; on Ollama's paths (``path``), Ollama's ``{"error": message}``."""
    if is_ollama(path):
        return json.dumps({"error": message}).encode()
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


Scope = dict[str, Any]


def scope_authorized(scope: Scope, digests: tuple[bytes, ...]) -> bool:
    """Whether an HTTP request (its ASGI ``scope``) presents one of the API keys
    (``digests``): ``Authorization: Bearer KEY``, else Anthropic's ``x-api-key``."""
    headers = dict(scope.get("headers", ()))
    if b"authorization" in headers:
        scheme, _, token = headers[b"authorization"].decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and check_api_key(token.strip(), digests)
    if b"x-api-key" in headers:  # Anthropic's header, as its clients send it
        return check_api_key(headers[b"x-api-key"].decode("latin-1").strip(), digests)
    return False


Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiGuard:
    """ASGI middleware enforcing :class:`ApiLimits` in front of the API app.

    Order, per HTTP request: API key (``/v1/*``, ``/api/*``, ``/metrics``; 401) -> for
    ``POST`` to those a concurrency slot (429 + ``Retry-After`` when the queue is full;
    no body byte is read before a slot is held) -> body size (413; the body is
    read into memory up to the limit, then handed to the app). So at most
    ``(max_concurrent_requests + max_queue) x max_body_bytes`` of bodies are
    held, and a rejected request costs no parsing. Other paths (``/healthz``,
    ``/openapi.json``, ``/docs``) only get the body limit.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], limits: ApiLimits,
                 requests: ConcurrencyLimiter | None = None):
        self.app = app
        self.limits = limits
        self.requests = requests or ConcurrencyLimiter(limits.max_concurrent_requests, limits.max_queue)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        protected = path == "/v1" or path.startswith("/v1/") or path == "/metrics" or is_ollama(path)
        if protected and self.limits.api_key_digests and not self._authorized(scope):
            await _respond(send, 401, error_body(401, "Incorrect or missing API key: send "
                                                 "'Authorization: Bearer <key>'", "invalid_api_key", path=path),
                           [(b"www-authenticate", b'Bearer realm="ringlet"')])
            return
        if protected and scope.get("method") == "POST":
            try:
                async with self.requests.slot():
                    await self._with_body_limit(scope, receive, send)
            except Overloaded as exc:
                await _respond(send, 429, error_body(
                    429, f"this node is busy ({self.requests.running} requests running, "
                         f"{self.requests.waiting} waiting); retry after {exc.retry_after_s} s",
                    "rate_limit_exceeded", "rate_limit_error", path=path),
                    [(b"retry-after", str(exc.retry_after_s).encode())])
            return
        await self._with_body_limit(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        return scope_authorized(scope, self.limits.api_key_digests)

    async def _with_body_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limits.max_body_bytes
        path = scope.get("path", "")
        too_large = error_body(413, f"the request body is larger than {limit} bytes", "request_too_large", path=path)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _respond(send, 400, error_body(400, "bad Content-Length header", path=path))
                    return
                if declared > limit:
                    await _respond(send, 413, too_large)
                    return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _respond(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- OpenAPI


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_OLLAMA_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
# One server-sent event (OpenAPI before 3.2: the schema of text/event-stream describes each
# event): ``data`` is a JSON chunk, or ``[DONE]`` at the end.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer", "minimum": 0}},
}
_ERRORS = {
    "400": "Invalid request (wrong types, out-of-range values, prompt too long)",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "429": "Too many requests running and waiting; see Retry-After",
    "503": "The generation failed on some stage",
}


def document(app: Any, limits: ApiLimits) -> None:
    """Make ``app``'s OpenAPI schema say what the API really answers: the error
    responses the guard and handlers produce (400 instead of FastAPI's 422),
    server-sent events for streaming, and the bearer scheme when keys are set."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(Error=_ERROR_SCHEMA, OllamaError=_OLLAMA_ERROR_SCHEMA)
        if limits.api_key_digests:
            components.setdefault("securitySchemes", {})["apiKey"] = {"type": "http", "scheme": "bearer"}
        for path, item in schema.get("paths", {}).items():
            ollama = is_ollama(path)  # errors {"error": "..."}, streams of newline-delimited JSON
            if not (path == "/v1" or path.startswith("/v1/") or ollama):
                continue
            ref = "#/components/schemas/" + ("OllamaError" if ollama else "Error")
            error = {"content": {"application/json": {"schema": {"$ref": ref}}}}
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                codes = ["401"] if limits.api_key_digests else []
                if method == "post":
                    codes += ["400", "404", "413", "429", "503"]
                    ok = responses.setdefault("200", {"description": "Successful Response"})
                    if not ollama:
                        ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": _SSE_EVENT})
                    elif path.endswith(("/chat", "/generate")):
                        ok.setdefault("content", {}).setdefault("application/x-ndjson", {"schema": {"type": "object"}})
                for code in codes:
                    responses[code] = {"description": _ERRORS[code], **error}
                if limits.api_key_digests:
                    op["security"] = [{"apiKey": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def install(app: Any, limits: ApiLimits) -> None:
    """Put :class:`ApiGuard` in front of ``app`` and document it (see :func:`document`).

    The guard's admission queue is ``app.state.admission`` (shown by ``/v1/cluster``).

    Also gives the framework's own HTTP errors (unparsable JSON body, unknown path,
    wrong method) OpenAI's error shape instead of ``{"detail": ...}``.
    """
    from starlette.exceptions import HTTPException
    from starlette.responses import Response

    async def http_error(request: Any, exc: HTTPException) -> Response:
        return Response(error_body(exc.status_code, str(exc.detail), path=request.url.path),
                        status_code=exc.status_code, headers=dict(exc.headers or {}), media_type="application/json")

    app.add_exception_handler(HTTPException, http_error)
    app.state.admission = ConcurrencyLimiter(limits.max_concurrent_requests, limits.max_queue)
    app.add_middleware(ApiGuard, limits=limits, requests=app.state.admission)
    document(app, limits)
