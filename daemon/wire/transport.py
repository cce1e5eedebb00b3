"""gRPC transport: every ringlet server and channel is made here.

One place decides message limits, keepalive and (with a cluster secret) the
security of every RPC, so no call path can bypass it.

With a secret (``TransportConfig.secret``):

* **TLS.** Servers listen only with TLS, presenting a certificate signed by the
  CA derived from the secret (tls.py); channels trust only that CA. Traffic is
  encrypted and a client only ever talks to a server holding the secret.
* **Per-call authentication.** Channels carry call credentials that add an
  HMAC token (auth.py: method, time, nonce) to every call, so every stub, stream
  and future method is covered without its code doing anything. The server's
  interceptor checks the token *before* the method is looked up or a request
  byte is read: a call without a valid token gets ``UNAUTHENTICATED`` with the
  same detail whatever the reason (and for unknown methods too), reaches no
  servicer code, and is logged once per (peer host, reason).

Always (with or without a secret): a per-peer token-bucket rate limit on control
RPCs (every method but the data-plane :data:`DATA_PLANE_METHODS`), answered with
``RESOURCE_EXHAUSTED`` and a ``retry-after-ms`` trailer; message size and
concurrent-stream limits. Without a secret the plane is open (plaintext, no
authentication): :func:`make_server` warns once per process.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import grpc

from ringlet.daemon.wire.auth import (
    AUTH_METADATA_KEY,
    DEFAULT_REPLAY_CACHE_SIZE,
    DEFAULT_WINDOW_S,
    AuthError,
    TokenSigner,
    TokenVerifier,
    fingerprint,
)
from ringlet.daemon.wire.limits import RateLimiter

log = logging.getLogger(__name__)

#: Default largest gRPC message, bytes. gRPC's own default receive limit (4 MiB) is
#: too small for prefill hidden states.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024
#: The methods not rate-limited per peer: the data plane. Everything else (today
#: GetNodeInfo and Echo, and any method added later) is a control RPC.
DATA_PLANE_METHODS = frozenset({"/ringlet.v1.Ring/Hop", "/ringlet.v1.Ring/Generate", "/ringlet.v1.Ring/FetchShard"})
#: The detail of every UNAUTHENTICATED answer (the same whatever the reason).
UNAUTHENTICATED_DETAIL = "unauthenticated: this node requires the cluster secret"


@dataclass(frozen=True)
class TransportConfig:
    """Settings shared by a node's server and channels.

    Attributes:
        max_message_bytes: largest message sent or received, bytes.
        keepalive_s: seconds between HTTP/2 keepalive pings; a peer silent for
            ``keepalive_s + keepalive_timeout_s`` is declared dead by gRPC.
        keepalive_timeout_s: seconds to wait for a ping acknowledgement.
        secret: the cluster secret (:func:`ringlet.daemon.wire.auth.load_secret`), or
            ``None`` to run open.
        node_id: this node's id, carried in its call tokens (logs, per-peer limits).
        auth_window_s: a call token is accepted this many seconds either side of
            the server's clock (node clocks must agree that well: NTP).
        replay_cache_size: most call tokens remembered within the window.
        control_rate_per_s: control RPCs per second allowed per peer (sustained).
        control_burst: control RPCs allowed per peer at once.
        max_concurrent_streams: concurrent calls per connection (HTTP/2 streams).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    keepalive_s: float = 2.0
    keepalive_timeout_s: float = 2.0
    secret: bytes | None = field(default=None, repr=False)
    node_id: str = ""
    auth_window_s: float = DEFAULT_WINDOW_S
    replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE
    control_rate_per_s: float = 50.0
    control_burst: int = 100
    max_concurrent_streams: int = 256


def options(config: TransportConfig) -> list[tuple[str, int]]:
    """gRPC channel/server arguments (grpc core ``GRPC_ARG_*``; times in ms)."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.keepalive_s * 500)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(config.keepalive_s * 500)),
    ]


_warned_open = False


def make_server(config: TransportConfig, address: str) -> grpc.aio.Server:
    """A gRPC aio server bound to ``address`` (``host:port``); not started.

    With a secret it listens with TLS only and authenticates every call; without
    one it listens in plaintext and warns (once per process).

    Raises:
        OSError: the address cannot be bound.
        RingletError: a secret is set but the ``cryptography`` package is missing.
    """
    global _warned_open
    server = grpc.aio.server(
        interceptors=[ServerGuard(config)],
        # grpc turns SO_REUSEPORT on by default on Linux: a second daemon on a port in
        # use would bind it too and take half of the connections (hops, heartbeats)
        # meant for the first; off, the port in use is an error
        options=options(config) + [("grpc.max_concurrent_streams", config.max_concurrent_streams),
                                   ("grpc.so_reuseport", 0)],
    )
    if config.secret is not None:
        from ringlet.daemon.wire.tls import cluster_tls

        material = cluster_tls(config.secret)
        credentials = grpc.ssl_server_credentials([(material.key_pem, material.chain_pem)])
        bound = _bind(lambda: server.add_secure_port(address, credentials))
        log.info("gRPC on %s: TLS and per-call authentication (secret fingerprint %s)",
                 address, fingerprint(config.secret))
    else:
        bound = _bind(lambda: server.add_insecure_port(address))
        if not _warned_open:
            _warned_open = True
            log.warning("no cluster secret (--secret-file): the gRPC plane on %s is OPEN and unencrypted; "
                        "anyone who can reach it can join, feed tensors and read activations", address)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {address} (in use?)")
    return server


def _bind(add) -> int:
    """The port ``add()`` bound, 0 when it could not (grpc returns 0 or raises, by version)."""
    try:
        return add()
    except RuntimeError:
        return 0


def make_channel(config: TransportConfig, address: str, *, own_connection: bool = False) -> grpc.aio.Channel:
    """A gRPC aio channel to a peer at ``address`` (``host:port``).

    With a secret: TLS trusting only the cluster CA, and a call token on every call.
    With ``own_connection``, the channel shares no connection (grpc core subchannel)
    with other channels of this process to the same address, nor their reconnect
    backoff: a new such channel to a peer that was down dials it at once, where one
    sharing the connection of an older channel would fail fast until that connection's
    backoff (doubling to 2 minutes while the peer was down) runs out.
    """
    extra = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    if config.secret is None:
        return grpc.aio.insecure_channel(address, options=options(config) + extra)
    from ringlet.daemon.wire.tls import TLS_SERVER_NAME, cluster_tls

    material = cluster_tls(config.secret)
    credentials = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(root_certificates=material.ca_pem),
        grpc.metadata_call_credentials(_TokenPlugin(TokenSigner(config.secret, config.node_id)), name="ringlet"),
    )
    extra.append(("grpc.ssl_target_name_override", TLS_SERVER_NAME))
    return grpc.aio.secure_channel(address, credentials, options=options(config) + extra)


class _TokenPlugin(grpc.AuthMetadataPlugin):
    """Adds the call token; gRPC calls it for every call on the channel."""

    def __init__(self, signer: TokenSigner):
        self._signer = signer

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        # service_url is "https://<authority>/<package.Service>"; the method is "/<package.Service>/<Method>".
        service = context.service_url.split("://", 1)[-1].partition("/")[2]
        try:
            callback(((AUTH_METADATA_KEY, self._signer.token(f"/{service}/{context.method_name}")),), None)
        except Exception as exc:  # noqa: BLE001 - reported to gRPC, which fails the call
            callback((), exc)


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``1.2.3.4`` (``ipv6:[::1]:5678`` -> ``[::1]``)."""
    peer = context.peer() or "unknown"
    addr = peer.partition(":")[2] or peer
    return addr.rpartition(":")[0] or addr


class ServerGuard(grpc.aio.ServerInterceptor):
    """Authenticates every call (with a secret) and rate-limits control RPCs per peer."""

    def __init__(self, config: TransportConfig):
        self._verifier = (TokenVerifier(config.secret, config.auth_window_s, config.replay_cache_size)
                          if config.secret is not None else None)
        self._limiter = RateLimiter(config.control_rate_per_s, config.control_burst)
        self._logged: set[tuple[str, str]] = set()
        #: Calls rejected, by reason (for tests and diagnostics).
        self.rejected: dict[str, int] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        caller = ""
        if self._verifier is not None:
            token = None
            for key, value in handler_call_details.invocation_metadata or ():
                if key == AUTH_METADATA_KEY:
                    token = value
                    break
            try:
                caller = self._verifier.verify(method, token)
            except AuthError as exc:
                return self._reject(method, exc)
        handler = await continuation(handler_call_details)
        if handler is None or method in DATA_PLANE_METHODS:
            return handler
        return _wrap(handler, self._rate_check(caller))

    def _note(self, reason: str, host: str, message: str, *args: object) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        key = (host, reason)
        if key in self._logged:
            return
        if len(self._logged) >= 4096:
            self._logged.clear()
        self._logged.add(key)
        log.warning(message, *args)

    def _reject(self, method: str, exc: AuthError) -> grpc.RpcMethodHandler:
        # A stream-stream handler whatever the method's real shape: it answers
        # without reading the request, so no request byte is buffered or parsed.
        async def deny(request_iterator, context):
            self._note(exc.reason, _peer_host(context), "gRPC: rejected %s from %s: %s (logged once per peer "
                       "and reason)", method[:100], context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAIL)
            yield  # pragma: no cover - makes this an async generator

        return grpc.stream_stream_rpc_method_handler(deny)

    def _rate_check(self, caller: str):
        async def check(context: grpc.aio.ServicerContext) -> None:
            key = caller or _peer_host(context)
            wait = self._limiter.acquire(key)
            if wait > 0:
                self._note("rate", key, "gRPC: peer %s exceeds the control RPC rate limit (logged once)", key)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "control RPC rate limit exceeded",
                                    trailing_metadata=(("retry-after-ms", str(max(1, int(wait * 1000)))),))

        return check


def _wrap(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """``handler`` with ``await check(context)`` run before its behavior."""
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary_response(request, context):
            await check(context)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary_response, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    inner = handler.unary_stream or handler.stream_stream

    async def stream_response(request, context):
        await check(context)
        result = inner(request, context)
        if inspect.isasyncgen(result):
            async for item in result:
                yield item
        elif inspect.isawaitable(result):
            await result  # a behavior that writes with context.write()
        else:
            for item in result or ():
                yield item

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(stream_response, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
