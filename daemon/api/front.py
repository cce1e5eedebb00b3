"""The API of a node serving several models: each request goes to its model's lane.

A node started with several ``--model`` runs each model in its own lane (a child daemon,
:mod:`ringlet.daemon.ops.lanes`). This app serves the node's API port: a request that names
a ``model`` (every surface: OpenAI, Anthropic, Responses, Ollama) goes to the lane serving
it, by its id, its ``--model`` value or an alias (``--model-alias NAME=MODEL``), with the
body's ``model`` set to the lane's id; a request naming no model goes to the first lane (the
highest priority), as do the node's pages (the console, ``/healthz``, ``/metrics``; another
model's metrics: ``/metrics?model=NAME``).
Replies stream through as they come; a client that goes away closes the lane's request.

Its own endpoints: ``GET /v1/models`` and Ollama's ``GET /api/tags`` and ``/api/ps`` list
every model (``/v1/models`` with its state); ``GET /v1/cluster`` is the first lane's view with ``models`` (each model's
ring, state and memory); ``GET /v1/lanes`` the set of models (for the members'
agreement); ``POST /v1/models/load`` and ``/v1/models/unload`` change the set on every
member (API key when keys are set); ``POST /v1/lanes/reserve`` is the lanes' own (loopback).
"""

from __future__ import annotations

import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ringlet.daemon.api.error_body import error_response
from ringlet.daemon.wire.limits import scope_authorized

log = logging.getLogger("ringlet.daemon.api.front")

__all__ = ["HOP_HEADERS", "create_front_app"]

#: Headers never passed through a proxy (RFC 9110 7.6.1) or that the proxy sets itself.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length"})


def create_front_app(lanes, key_digests: tuple[bytes, ...], sync, max_body_bytes: int | None = None) -> FastAPI:
    """The node's API app over ``lanes`` (:class:`~ringlet.daemon.ops.lanes.Lanes`).

    Args:
        lanes: the node's lanes (``find``, ``default``, ``lanes``, ``reserve``, ``models``).
        key_digests: the API keys' digests (``--api-key-file``); empty: no key needed.
        sync: the members' agreement (:class:`~ringlet.daemon.ops.lane_sync.ModelSync`):
            ``load(model, aliases, headers)`` and ``unload(name, headers)`` on every member.
        max_body_bytes: ``--max-body-bytes``: a larger body is a 413 here, before it is read
            whole (the lanes check it again); ``None``: no limit.
    """
    app = FastAPI(title="ringlet", description="The API of a ringlet node serving several models")
    # no pool limit: each lane admits and queues its own requests (429 beyond), and a long
    # stream holds its connection for its whole length
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def read_body(request: Request) -> bytes | None:
        """The body, or ``None`` past ``max_body_bytes`` (read no further than that)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if max_body_bytes is not None and size > max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def authorized(request: Request) -> bool:
        return not key_digests or scope_authorized(request.scope, key_digests)

    def denied(request: Request) -> JSONResponse:
        return error_response(401, "a valid API key is needed (Authorization: Bearer KEY, or x-api-key)",
                              path=request.url.path)

    async def lane_json(lane, path: str, request: Request) -> dict | None:
        try:
            r = await client.get(lane.url + path, headers=_forwarded(request), timeout=5.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return denied(request)
        data = []
        for priority, lane in enumerate(lanes.lanes):
            info = {"state": lane.state, "priority": priority, "model": lane.model,
                    "reason": (lane.view or {}).get("infeasible") or None}
            name = lane.served or lane.key
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "ringlet", "ringlet": info})
            data += [{"id": alias, "object": "model", "created": 0, "owned_by": "ringlet",
                      "ringlet": {**info, "alias_of": name}} for alias in lane.aliases]
        return {"object": "list", "data": data}

    @app.get("/api/tags")
    @app.get("/api/ps")
    async def ollama_lists(request: Request):  # Ollama's lists: every model's, in priority order
        if not authorized(request):
            return denied(request)
        out = []
        for lane in lanes.lanes:
            body = await lane_json(lane, request.url.path, request)
            out += (body or {}).get("models", [])
        return {"models": out}

    @app.get("/v1/cluster")
    async def cluster(request: Request):
        if not authorized(request):
            return denied(request)
        view = dict(lanes.default.view or await lane_json(lanes.default, "/v1/cluster", request) or {})
        view["models"] = [{**lane.to_dict(), "priority": i, "epoch": (lane.view or {}).get("epoch"),
                           "node_id": (lane.view or {}).get("node_id"), "address": (lane.view or {}).get("address"),
                           "plan": (lane.view or {}).get("plan"), "infeasible": (lane.view or {}).get("infeasible"),
                           "layer_range": (lane.view or {}).get("layer_range"),
                           "requests_in_flight": (lane.view or {}).get("requests_in_flight"),
                           "num_layers": (lane.view or {}).get("num_layers"),
                           # the context its KV is planned for (--model-context, else --context)
                           "context_tokens": (((lane.view or {}).get("plan_detail") or {}).get("model")
                                              or {}).get("context_tokens")}
                          for i, lane in enumerate(lanes.lanes)]
        return view

    @app.get("/v1/lanes")
    async def lane_set(request: Request):
        if not authorized(request):
            return denied(request)
        return lanes.models()

    @app.post("/v1/lanes/reserve", include_in_schema=False)
    async def reserve(request: Request):
        if request.client is None or request.client.host not in ("127.0.0.1", "::1"):
            return error_response(403, "only this node's own model processes reserve memory", path=request.url.path)
        body = await request.json()
        return await lanes.reserve(str(body.get("model", "")), int(body.get("bytes", 0)))

    async def model_change(request: Request, what: str) -> tuple[dict, str] | JSONResponse:
        """The body and its ``model`` of a load or unload, or the error to answer."""
        if not authorized(request):
            return denied(request)
        body = await _body(request)
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model.strip():
            return error_response(400, f"model: the model to {what} is required", param="model",
                                  path=request.url.path)
        return body, model.strip()

    @app.post("/v1/models/load")
    async def load(request: Request):
        checked = await model_change(request, "load (a path, short name or ORG/NAME)")
        if isinstance(checked, JSONResponse):
            return checked
        body, model = checked
        aliases = body.get("aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            return error_response(400, "aliases: a list of names", param="aliases", path=request.url.path)
        try:
            result = await sync.load(model, aliases, _forwarded(request), bool(body.get("propagate", True)))
        except ValueError as exc:  # a model that cannot be read here (400), or one already served (409)
            status = 400 if str(exc).startswith("cannot load") else 409
            return error_response(status, str(exc), param="model", path=request.url.path)
        return result

    @app.post("/v1/models/unload")
    async def unload(request: Request):
        checked = await model_change(request, "unload")
        if isinstance(checked, JSONResponse):
            return checked
        body, model = checked
        try:
            return await sync.unload(model, _forwarded(request), bool(body.get("propagate", True)))
        except KeyError:
            return error_response(404, f"model {model!r} is not served here", param="model", path=request.url.path)
        except ValueError as exc:
            return error_response(409, str(exc), param="model", path=request.url.path)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])
    async def proxy(path: str, request: Request):
        raw = await read_body(request)
        if raw is None:
            return error_response(413, f"the request body is larger than {max_body_bytes} bytes",
                                  code="request_too_large", path="/" + path)
        lane, body = lanes.default, raw
        if path == "metrics" and request.query_params.get("model"):  # one model's metrics: /metrics?model=NAME
            lane = lanes.find(request.query_params["model"]) or lane
        if raw and request.method == "POST" and "json" in request.headers.get("content-type", "json"):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None  # the lane answers it with its own 400
            name = parsed.get("model") if isinstance(parsed, dict) else None
            if isinstance(name, str) and name:
                found = lanes.find(name) or lanes.find(name.removesuffix(":latest"))
                if found is None:
                    served = ", ".join(sorted(n for ln in lanes.lanes for n in (ln.served or ln.key, *ln.aliases)))
                    return error_response(404, f"model {name!r} is not served here; this cluster serves {served}",
                                          param="model", code="model_not_found", path="/" + path)
                lane = found
                if lane.served and name != lane.served:
                    parsed["model"] = lane.served
                    body = json.dumps(parsed).encode()
        if lane.state == "failed":
            return error_response(503, f"model {lane.served or lane.key} could not start on this node (see its "
                                       f"log); the other models serve", path="/" + path)
        if lane.state in ("starting", "restarting") and lane.view is None:
            return error_response(503, f"model {lane.served or lane.key} is starting on this node; try again shortly",
                                  path="/" + path)
        url = httpx.URL(lane.url + "/" + path, params=request.url.query.encode() or None)
        upstream = client.build_request(request.method, url, headers=_forwarded(request), content=body)
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return error_response(503, f"model {lane.served or lane.key}: its process did not answer ({exc}); "
                                       f"it is being restarted", path="/" + path)
        headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS}

        async def relay():
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                with contextlib.suppress(Exception):
                    await reply.aclose()

        return StreamingResponse(relay(), status_code=reply.status_code, headers=headers)

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()

    return app


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


async def _body(request: Request):
    try:
        return await request.json()
    except ValueError:
        return None


