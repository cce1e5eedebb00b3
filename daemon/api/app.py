"""The HTTP API (FastAPI) every node serves.

Endpoints: OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions``
(:mod:`ringlet.daemon.api.openai_api`), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`ringlet.daemon.api.anthropic_api`), OpenAI's
``POST /v1/responses`` (:mod:`ringlet.daemon.api.responses_api`), Ollama's ``/api/chat``,
``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``
(:mod:`ringlet.daemon.api.ollama_api`), and ``GET /v1/models``,
``GET /v1/cluster``, ``GET /healthz``, ``GET /metrics`` (:mod:`ringlet.daemon.api.metrics`), and
the web console at ``/`` with its live view ``GET /v1/console/events`` (:mod:`ringlet.daemon.api.console`).
Each API surface is an adapter over one internal request type and event stream
(:mod:`ringlet.daemon.api.request`, :mod:`ringlet.daemon.api.pipeline`). Bad requests get a 4xx JSON error in the
surface's own shape, naming the field; the node keeps serving.

Tokenization, the chat template and streaming detokenization are the model's own,
through mlx-lm's ``TokenizerWrapper``.
"""

from __future__ import annotations

import hashlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from ringlet.daemon.api import anthropic_api, console, ollama_api, openai_api, responses_api
from ringlet.daemon.api.error_body import error_response as _error
from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.api.metrics import CONTENT_TYPE_LATEST, CountRequests, Metrics
from ringlet.daemon.api.pipeline import Pipeline
from ringlet.daemon.api.seal import Sealer
from ringlet.daemon.api.ticker import ClientGone
from ringlet.daemon.api.tokenizer import LazyTokenizer
from ringlet.daemon.node import Node
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.limits import ApiLimits, install

log = logging.getLogger(__name__)

def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """``(message, param)`` of a body that failed validation: an unknown field is
    "unsupported field"; a body that is not JSON says so, with the character where it
    broke (``param`` empty); otherwise pydantic's reason, with the field's dotted path."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "extra_forbidden":
        return f"unsupported field {loc!r}: ringlet does not support it (it is never ignored in silence)", loc
    if first.get("type") == "json_invalid":  # loc is ("body", character offset), not a field
        where = first.get("loc", ("body", "?"))[-1]
        reason = (first.get("ctx") or {}).get("error") or first.get("msg") or "malformed"
        return f"invalid request: the body is not valid JSON ({reason} at character {where})", ""
    return f"invalid request: {loc or 'body'}: {first.get('msg', 'malformed body')}", loc


def seal_material(node: Node) -> bytes:
    """What the reasoning seal's key derives from: the cluster secret, else the cluster
    id (every member has it; see :mod:`ringlet.daemon.api.seal`)."""
    transport = getattr(getattr(node, "config", None), "transport", None)  # node is None for the OpenAPI schema
    secret = getattr(transport, "secret", None)
    if secret:
        return bytes(secret)
    return ("ringlet cluster " + str(getattr(node, "cluster_id", "") or "")).encode()


def create_app(node: Node, tokenizer: LazyTokenizer, model_name: str, context_tokens: int,
               limits: ApiLimits | None = None) -> FastAPI:
    """Build the FastAPI app for a node.

    Args:
        node: the serving node.
        tokenizer: the model's mlx-lm ``TokenizerWrapper``, built on first use.
        model_name: the id reported by ``/v1/models`` and in responses.
        context_tokens: the model's context length; prompts longer than it are rejected
            and ``max_tokens`` is clamped to what remains.
        limits: API key, body size, prompt and completion caps, concurrency (limits.py).
    """
    app = FastAPI(title="ringlet", version="0.1.0", description="OpenAI-compatible API of a ringlet node")
    limits = limits or ApiLimits()
    install(app, limits)  # API key on /v1/*, body size, concurrency + queue (429); see limits.py

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, loc = validation_message(exc)
        return _error(400, message, param=loc, path=request.url.path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.code, path=request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        log.info("%s: %s before the reply; its generation was stopped", request.url.path, exc)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", path=request.url.path)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "state": node.state, "node_id": node.node_id, "release": versions.RELEASE,
                "protocol_version": versions.PROTOCOL_VERSION}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ringlet"}]}

    @app.post("/v1/models/load")
    @app.post("/v1/models/unload")
    async def models_change(request: Request):
        return _error(400, f"this node serves one model ({model_name}): to load and unload models while it "
                           "runs, start it with several --model, or with a --model-alias (as a service: "
                           f"ringlet service install --model {model_name} --model OTHER)", path=request.url.path)

    def cluster_view() -> dict:
        admission = app.state.admission
        return {**node.info(), "api": {"running": admission.running, "queued": admission.waiting,
                                       "max_concurrent_requests": admission.max_running,
                                       "max_queue": admission.max_waiting}}

    @app.get("/v1/cluster")
    async def cluster():
        return cluster_view()

    def cache_scope(request: Request) -> str:
        """The prefix cache scope of a request: its API key's digest when the node checks
        keys and scopes entries per key (``--prefix-cache-scope key``), else the cluster's."""
        if not limits.api_key_digests or node.config.prefix_cache_scope != "key":
            return ""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if not key.strip():
            key = request.headers.get("x-api-key", "")
        raw = key.strip().encode("utf-8", "surrogateescape")
        return hashlib.sha256(b"ringlet prefix scope\0" + raw).hexdigest()[:32]

    app.state.cache_scope = cache_scope
    app.state.sealer = Sealer(seal_material(node), model_name)
    pipeline = Pipeline(node, tokenizer, model_name, context_tokens, limits)
    app.state.pipeline = pipeline
    metrics = Metrics(node, lambda: (app.state.admission.running, app.state.admission.waiting))
    pipeline.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.add_middleware(CountRequests, metrics=metrics)
    # the API surfaces: each an adapter over the pipeline (one line each)
    if getattr(node, "engine", None) is not None:  # the last stage applies grammars with the model's tokenizer
        from ringlet.daemon.engine.grammar import ll_tokenizer

        # on the MLX worker thread: the first grammar on a node that took no request yet builds it
        node.engine.grammar_tokenizer = lambda width: ll_tokenizer(tokenizer.get_blocking()._tokenizer, width)
    openai_api.register(app, pipeline)
    responses_api.register(app, pipeline)
    anthropic_api.register(app, pipeline)
    ollama_api.register(app, pipeline)
    console.register(app, cluster_view)  # the web console at / and its live view
    return app
