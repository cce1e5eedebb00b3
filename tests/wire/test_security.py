"""Cluster secret, per-call authentication, TLS, replay, rate and API limits — in one process.

The gRPC tests run the real ``transport.make_server`` / ``make_channel`` with a
servicer that only counts calls, so "changes nothing" is exact: a rejected call
leaves every counter at zero. Methods are enumerated from the generated
descriptor, so a method added to ``proto/ringlet.proto`` is covered without
editing this file. The real daemons are in test_security_cluster.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time

import grpc
import httpx
import pytest
from fastapi import FastAPI

from ringlet.daemon.ops import cli
from ringlet.daemon.ops.demo import free_ports
from ringlet.daemon.wire import auth, limits, transport
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.tls import TLS_SERVER_NAME, cluster_tls

try:
    import cryptography  # noqa: F401 - the TLS material needs it; the rest of this file does not
except ImportError:  # pragma: no cover - a runtime dependency of --secret-file
    HAVE_CRYPTOGRAPHY = False
else:
    HAVE_CRYPTOGRAPHY = True
needs_tls = pytest.mark.skipif(not HAVE_CRYPTOGRAPHY, reason="TLS needs the cryptography package")

SERVICE = pb.DESCRIPTOR.services_by_name["Ring"]
METHODS = list(SERVICE.methods)
SECRET = b"a" * 16 + auth.new_secret().encode()[:32]
WRONG = auth.new_secret().encode()


def path_of(m) -> str:
    return f"/{SERVICE.full_name}/{m.name}"


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# --------------------------------------------------------------------------- secret files


def test_secret_new_writes_0600_and_loads(tmp_path):
    path = tmp_path / "sub" / "cluster.secret"
    assert cli.main(["secret", "new", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = auth.load_secret(path)
    assert len(secret) == 64 and all(c in b"0123456789abcdef" for c in secret)
    assert cli.main(["secret", "new", str(path)]) == 2  # never overwritten silently
    assert auth.load_secret(path) == secret
    assert cli.main(["secret", "new", "--force", str(path)]) == 0
    assert auth.load_secret(path) != secret and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_secret_new_ignores_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        p = auth.write_secret(tmp_path / "s")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


@pytest.mark.parametrize("content, mode, match", [
    ("x" * 64 + "\n", 0o644, "chmod 600"),
    ("x" * 64, 0o640, "group or others"),
    ("short\n", 0o600, "at least 32"),
    ("", 0o600, "empty"),
    ("two words " + "x" * 40, 0o600, "one word"),
    ("é" * 40, 0o600, "non-ASCII"),
])
def test_bad_secret_files_are_refused_with_the_fix(tmp_path, content, mode, match):
    p = tmp_path / "s"
    p.write_text(content)
    p.chmod(mode)
    with pytest.raises(auth.SecretError, match=match) as info:
        auth.load_secret(p)
    assert content.strip()[:8] not in str(info.value) or not content.strip()  # never echoes the secret


def test_missing_secret_file_and_directory(tmp_path):
    with pytest.raises(auth.SecretError, match="cannot read"):
        auth.load_secret(tmp_path / "nope")
    with pytest.raises(auth.SecretError):
        auth.load_secret(tmp_path)


def test_crlf_and_copies_give_the_same_secret(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("k" * 40 + "\n")
    b.write_bytes(b"  " + b"k" * 40 + b"\r\n")
    for p in (a, b):
        p.chmod(0o600)
    assert auth.load_secret(a) == auth.load_secret(b) == b"k" * 40


def test_run_refuses_a_bad_secret_file_in_one_line(tmp_path, capsys):
    p = tmp_path / "s"
    p.write_text("x" * 64)
    p.chmod(0o644)
    from ringlet.daemon.ops.secret import transport_config

    parser = cli._parser()
    args = parser.parse_args(["run", "--secret-file", str(p)])
    with pytest.raises(auth.SecretError, match="chmod 600"):
        transport_config(args)


def test_hkdf_matches_rfc5869_and_keys_are_independent():
    # RFC 5869, test case 1
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = auth.hkdf_sha256(ikm, info, 42, salt)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
    keys = {auth.derive_key(SECRET, p) for p in ("rpc-token", "tls-ca-key", "fingerprint")}
    assert len(keys) == 3
    assert auth.fingerprint(SECRET) == auth.fingerprint(bytes(SECRET)) != auth.fingerprint(WRONG)


# --------------------------------------------------------------------------- tokens


def test_token_accepted_once_for_its_method_only():
    signer, verifier = auth.TokenSigner(SECRET, "node-a"), auth.TokenVerifier(SECRET, window_s=10)
    tok = signer.token("/ringlet.v1.Ring/Echo")
    assert verifier.verify("/ringlet.v1.Ring/Echo", tok) == "node-a"
    with pytest.raises(auth.AuthError) as e:
        verifier.verify("/ringlet.v1.Ring/Echo", tok)
    assert e.value.reason == "replay"
    with pytest.raises(auth.AuthError) as e:
        verifier.verify("/ringlet.v1.Ring/Commit", signer.token("/ringlet.v1.Ring/Echo"))
    assert e.value.reason == "bad_mac"
    with pytest.raises(auth.AuthError) as e:
        verifier.verify("/ringlet.v1.Ring/Echo", auth.TokenSigner(WRONG).token("/ringlet.v1.Ring/Echo"))
    assert e.value.reason == "bad_mac"


def test_token_time_window_both_ways():
    signer, verifier = auth.TokenSigner(SECRET), auth.TokenVerifier(SECRET, window_s=30)
    now = 1_800_000_000.0
    for skew, ok in ((-29, True), (29, True), (-31, False), (31, False)):
        tok = signer.token("/p.S/M", now=now + skew)
        if ok:
            verifier.verify("/p.S/M", tok, now=now)
        else:
            with pytest.raises(auth.AuthError) as e:
                verifier.verify("/p.S/M", tok, now=now)
            assert e.value.reason == "stale"


def test_tampered_tokens_are_rejected():
    signer, verifier = auth.TokenSigner(SECRET, "n1"), auth.TokenVerifier(SECRET)
    tok = signer.token("/p.S/M")
    parts = tok.split(";")
    variants = [
        ";".join([parts[0], "n2", *parts[2:]]),  # other caller
        ";".join([*parts[:2], str(int(parts[2]) + 1), *parts[3:]]),  # other time
        ";".join([*parts[:3], "0" * 32, parts[4]]),  # other nonce
        tok[:-1] + ("0" if tok[-1] != "0" else "1"),  # other mac
    ]
    for bad in variants:
        with pytest.raises(auth.AuthError) as e:
            verifier.verify("/p.S/M", bad)
        assert e.value.reason == "bad_mac"
    for junk in (None, "", "v2;x", tok + ";", tok.upper(), "x" * 10_000, b"\xff"):
        with pytest.raises(auth.AuthError) as e:
            verifier.verify("/p.S/M", junk)
        assert e.value.reason in ("missing", "malformed")
    assert len(verifier.cache) == 0  # junk never fills the replay cache


def test_replay_cache_expires_and_fails_closed_when_full():
    cache = auth.ReplayCache(max_entries=2)
    assert cache.add("a", expires_at=10, now=0) and cache.add("b", expires_at=20, now=0)
    assert not cache.add("a", expires_at=10, now=5)
    with pytest.raises(auth.AuthError, match="cache_full"):
        cache.add("c", expires_at=30, now=5)
    assert cache.add("c", expires_at=30, now=10.5)  # "a" expired
    assert len(cache) == 2


# --------------------------------------------------------------------------- gRPC, in process


class Counting:
    """A server for every Ring method that counts calls and records their metadata."""

    def __init__(self, config: transport.TransportConfig):
        self.calls: dict[str, int] = {}
        self.metadata: list[tuple] = []
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.server = transport.make_server(config, self.address)
        handlers = {m.name: self._handler(m) for m in METHODS}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))

    def _handler(self, m):
        req, resp = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)

        def note(context):
            self.calls[m.name] = self.calls.get(m.name, 0) + 1
            self.metadata.append(tuple(context.invocation_metadata()))

        if m.client_streaming and m.server_streaming:
            async def behavior(it, context):
                note(context)
                async for _ in it:
                    pass
                yield resp()
            return grpc.stream_stream_rpc_method_handler(behavior, req.FromString, resp.SerializeToString)
        if m.client_streaming:
            async def behavior(it, context):
                note(context)
                async for _ in it:
                    pass
                return resp()
            return grpc.stream_unary_rpc_method_handler(behavior, req.FromString, resp.SerializeToString)
        if m.server_streaming:
            async def behavior(request, context):
                note(context)
                yield resp()
            return grpc.unary_stream_rpc_method_handler(behavior, req.FromString, resp.SerializeToString)

        async def behavior(request, context):
            note(context)
            return resp()
        return grpc.unary_unary_rpc_method_handler(behavior, req.FromString, resp.SerializeToString)


async def call(channel: grpc.aio.Channel, m, metadata=None, request=None, timeout: float = 10) -> grpc.StatusCode:
    """Call method ``m`` (a descriptor) once; return the status code."""
    req = request if request is not None else getattr(pb, m.input_type.name)()
    ser, de = (lambda x: x.SerializeToString()), getattr(pb, m.output_type.name).FromString
    path = path_of(m)
    if m.client_streaming:
        # A refused stream can be closed before the client's own write lands; grpc-aio then
        # reports that write's failure (INTERNAL "Failed execute_batch") instead of the status
        # the server sent: 3 calls in 3,000 on a loaded machine, and retries that write lose
        # the same race together (8 in a row on CI). So the retry sends headers only: a refusal
        # is decided on the headers, before any message, and cannot race a write that is never
        # made; a server that accepted would wait for the message and time out (DEADLINE_EXCEEDED).
        make = channel.stream_stream if m.server_streaming else channel.stream_unary
        for send in (True, False):
            c = make(path, request_serializer=ser, response_deserializer=de)(metadata=metadata, timeout=timeout)
            try:
                if send:
                    await c.write(req)
                    await c.done_writing()
                if m.server_streaming:
                    async for _ in c:
                        pass
                else:
                    await c
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass
            code = await c.code()
            if code != grpc.StatusCode.INTERNAL:
                return code
        return code
    try:
        if m.server_streaming:
            c = channel.unary_stream(path, request_serializer=ser, response_deserializer=de)(
                req, metadata=metadata, timeout=timeout)
            async for _ in c:
                pass
        else:
            await channel.unary_unary(path, request_serializer=ser, response_deserializer=de)(
                req, metadata=metadata, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def tls_only_channel(address: str, ca_pem: bytes) -> grpc.aio.Channel:
    """A client that completes TLS (the CA certificate is public: every handshake sends it)
    but has no call credentials: the attacker's best position without the secret."""
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem),
                                   options=[("grpc.ssl_target_name_override", TLS_SERVER_NAME)])


@needs_tls
def test_every_method_needs_the_secret_and_rejected_calls_change_nothing(caplog):
    config = transport.TransportConfig(secret=SECRET, node_id="server")

    async def main():
        srv = Counting(config)
        await srv.server.start()
        try:
            ca = cluster_tls(SECRET).ca_pem
            async with tls_only_channel(srv.address, ca) as ch:
                forged = auth.TokenSigner(WRONG, "intruder")
                for m in METHODS:
                    assert await call(ch, m) == grpc.StatusCode.UNAUTHENTICATED, m.name
                    md = ((auth.AUTH_METADATA_KEY, forged.token(path_of(m))),)
                    assert await call(ch, m, md) == grpc.StatusCode.UNAUTHENTICATED, m.name
                # an unknown method is not revealed as such
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary("/ringlet.v1.Ring/NoSuchMethod")(b"", timeout=5)
                unknown = info.value
                assert unknown.code() == grpc.StatusCode.UNAUTHENTICATED
                assert unknown.details() == transport.UNAUTHENTICATED_DETAIL
                # 64 MiB without a token: refused on its headers, quickly
                t0 = time.perf_counter()
                big = pb.Ping(payload=b"\0" * (64 << 20))
                assert await call(ch, SERVICE.methods_by_name["Echo"], request=big) == \
                    grpc.StatusCode.UNAUTHENTICATED
                assert time.perf_counter() - t0 < 10
            # the wrong secret's own transport does not even trust this server
            async with transport.make_channel(transport.TransportConfig(secret=WRONG), srv.address) as ch:
                for m in METHODS:
                    assert await call(ch, m, timeout=5) == grpc.StatusCode.UNAVAILABLE, m.name
            # plaintext (a node without a secret) gets nowhere either
            async with transport.make_channel(transport.TransportConfig(), srv.address) as ch:
                assert await call(ch, METHODS[0], timeout=5) == grpc.StatusCode.UNAVAILABLE
            assert srv.calls == {}, "a rejected call reached a servicer"
            # the right secret reaches every method
            async with transport.make_channel(transport.TransportConfig(secret=SECRET, node_id="n1"),
                                              srv.address) as ch:
                for m in METHODS:
                    assert await call(ch, m) == grpc.StatusCode.OK, m.name
            assert srv.calls == {m.name: 1 for m in METHODS}
        finally:
            await srv.server.stop(0)

    with caplog.at_level(logging.WARNING, logger="ringlet.daemon.wire.transport"):
        run(main(), timeout=60)
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert any("missing" in m for m in rejected) and any("bad_mac" in m for m in rejected)
    # logged once per (peer, reason), not once per call
    assert len(rejected) <= 3, rejected


@needs_tls
def test_unauthenticated_bodies_are_never_read():
    """A server whose message limit is 1 MiB: 4 MiB from a member is RESOURCE_EXHAUSTED (the
    body was read and measured); 4 MiB without a token is UNAUTHENTICATED (it never was)."""
    config = transport.TransportConfig(secret=SECRET, max_message_bytes=1 << 20)
    echo = SERVICE.methods_by_name["Echo"]
    big = pb.Ping(payload=b"\0" * (4 << 20))

    async def main():
        srv = Counting(config)
        await srv.server.start()
        try:
            async with tls_only_channel(srv.address, cluster_tls(SECRET).ca_pem) as ch:
                assert await call(ch, echo, request=big) == grpc.StatusCode.UNAUTHENTICATED
            member = transport.TransportConfig(secret=SECRET, max_message_bytes=8 << 20)
            async with transport.make_channel(member, srv.address) as ch:
                assert await call(ch, echo, request=big) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert srv.calls == {}
        finally:
            await srv.server.stop(0)

    run(main())


@needs_tls
def test_recorded_call_replayed_is_rejected_within_and_after_its_window(caplog):
    window = 1.0
    config = transport.TransportConfig(secret=SECRET, auth_window_s=window)
    echo = SERVICE.methods_by_name["Echo"]

    async def main():
        srv = Counting(config)
        await srv.server.start()
        try:
            async with transport.make_channel(transport.TransportConfig(secret=SECRET), srv.address) as ch:
                assert await call(ch, echo) == grpc.StatusCode.OK
            recorded = [(k, v) for k, v in srv.metadata[0] if k == auth.AUTH_METADATA_KEY]
            assert len(recorded) == 1
            sent_at = int(recorded[0][1].split(";")[2]) / 1000
            async with tls_only_channel(srv.address, cluster_tls(SECRET).ca_pem) as ch:
                assert await call(ch, echo, recorded) == grpc.StatusCode.UNAUTHENTICATED  # within: a repeat
                other = SERVICE.methods_by_name["Commit"]
                assert await call(ch, other, recorded) == grpc.StatusCode.UNAUTHENTICATED  # not its method
                await asyncio.sleep(max(0.0, sent_at + window + 0.2 - time.time()))
                assert await call(ch, echo, recorded) == grpc.StatusCode.UNAUTHENTICATED  # after: stale
            assert srv.calls == {"Echo": 1}
        finally:
            await srv.server.stop(0)

    with caplog.at_level(logging.WARNING, logger="ringlet.daemon.wire.transport"):
        run(main())
    text = caplog.text
    assert "replay" in text and "bad_mac" in text and "stale" in text


@needs_tls
def test_control_rpcs_are_rate_limited_per_peer_data_plane_is_not():
    config = transport.TransportConfig(secret=SECRET, control_rate_per_s=0.5, control_burst=2)

    async def main():
        srv = Counting(config)
        await srv.server.start()
        try:
            async with transport.make_channel(transport.TransportConfig(secret=SECRET, node_id="a"),
                                              srv.address) as a, \
                    transport.make_channel(transport.TransportConfig(secret=SECRET, node_id="b"), srv.address) as b:
                info = SERVICE.methods_by_name["GetNodeInfo"]
                codes = [await call(a, info) for _ in range(3)]
                assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED]
                assert await call(b, info) == grpc.StatusCode.OK  # another peer has its own bucket
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await a.unary_unary(path_of(info), request_serializer=lambda x: x.SerializeToString(),
                                        response_deserializer=pb.NodeInfo.FromString)(pb.NodeInfoRequest())
                assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert int(dict(exc.value.trailing_metadata() or ())["retry-after-ms"]) > 0
                for name in ("Hop", "Generate"):
                    for _ in range(5):
                        assert await call(a, SERVICE.methods_by_name[name]) == grpc.StatusCode.OK
        finally:
            await srv.server.stop(0)

    run(main())


def test_without_a_secret_the_plane_is_open_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(transport, "_warned_open", False)

    async def main():
        servers = [Counting(transport.TransportConfig()) for _ in range(2)]
        for s in servers:
            await s.server.start()
        try:
            async with transport.make_channel(transport.TransportConfig(), servers[0].address) as ch:
                assert await call(ch, SERVICE.methods_by_name["Echo"]) == grpc.StatusCode.OK
        finally:
            for s in servers:
                await s.server.stop(0)

    with caplog.at_level(logging.WARNING, logger="ringlet.daemon.wire.transport"):
        run(main())
    assert sum("OPEN" in r.getMessage() for r in caplog.records) == 1


@needs_tls
def test_every_member_derives_the_same_ca_and_a_fresh_leaf():
    a = cluster_tls(SECRET)
    assert cluster_tls(SECRET) is a
    from ringlet.daemon.wire import tls

    b = tls._make(SECRET)  # what another process makes
    assert b.ca_fingerprint == a.ca_fingerprint and b.key_pem != a.key_pem
    assert tls._make(WRONG).ca_fingerprint != a.ca_fingerprint
    from cryptography import x509

    leaf = x509.load_pem_x509_certificates(b.chain_pem)[0]
    ca = x509.load_pem_x509_certificate(a.ca_pem)
    leaf.verify_directly_issued_by(ca)  # a leaf made elsewhere verifies under our CA


# --------------------------------------------------------------------------- HTTP API guard


KEY = "k-" + "z" * 30


def guarded_app(**kw) -> tuple[FastAPI, asyncio.Event]:
    app = FastAPI()
    gate = asyncio.Event()

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/completions")
    async def completions(body: dict):
        await gate.wait()
        return {"n": len(str(body))}

    limits.install(app, limits.ApiLimits(**kw))
    return app, gate


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_api_key_on_v1_only(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# rotation: old and new\n{KEY}\n\nk-{'y' * 30}\n")
    keys.chmod(0o600)
    digests = auth.load_api_keys(keys)
    assert len(digests) == 2
    app, gate = guarded_app(api_key_digests=digests)
    gate.set()

    async def main():
        async with client(app) as c:
            assert (await c.get("/healthz")).status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong-key-xxxxxxxxxxxxxxxx"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = await c.get("/v1/models", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"].startswith("Bearer")
            r = await c.get("/v1/nonexistent")
            assert r.status_code == 401  # does not reveal which paths exist
            for key in (KEY, "k-" + "y" * 30):
                assert (await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
            r = await c.post("/v1/completions", json={"a": 1}, headers={"Authorization": f"bearer {KEY}"})
            assert r.status_code == 200

    run(main())


@pytest.mark.parametrize("content, match", [
    ("short\n", "at least 16"), ("# only a comment\n", "no API key"),
])
def test_bad_api_key_files(tmp_path, content, match):
    p = tmp_path / "keys"
    p.write_text(content)
    p.chmod(0o600)
    with pytest.raises(auth.SecretError, match=match):
        auth.load_api_keys(p)
    p.chmod(0o604)
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.load_api_keys(p)


def test_body_limit_declared_and_streamed():
    app, gate = guarded_app(max_body_bytes=1000)
    gate.set()

    async def chunks():
        for _ in range(10):
            yield b"x" * 200

    async def main():
        async with client(app) as c:
            assert (await c.post("/v1/completions", json={"p": "x" * 100})).status_code == 200
            r = await c.post("/v1/completions", content=b"{" + b" " * 2000 + b"}",
                             headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413  # no Content-Length: counted while reading
            r = await c.post("/v1/completions", content=b"\x0f\xff{", headers={"content-type": "application/json"})
            assert r.status_code in (400, 422) and "error" in r.json()  # OpenAI's shape, not {"detail": ...}

    run(main())


def test_concurrency_queue_then_429_with_retry_after():
    app, gate = guarded_app(max_concurrent_requests=1, max_queue=1)

    async def main():
        async with client(app) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={}))
            second = asyncio.create_task(c.post("/v1/completions", json={}))
            await asyncio.sleep(0.2)
            r = await c.post("/v1/completions", json={})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await c.get("/v1/models")).status_code == 200  # reads are not queued
            gate.set()
            assert [(await t).status_code for t in (first, second)] == [200, 200]
            assert (await c.post("/v1/completions", json={})).status_code == 200

    run(main())


def test_concurrency_limiter_cancelled_waiter_frees_its_place():
    lim = limits.ConcurrencyLimiter(1, 2)

    async def main():
        async with lim.slot():
            waiter = asyncio.create_task(lim.slot().__aenter__())
            await asyncio.sleep(0)
            assert lim.waiting == 1
            waiter.cancel()
            await asyncio.sleep(0)
            assert lim.waiting == 0
        assert lim.running == 0

    run(main())


def test_rate_limiter_refills():
    now = [0.0]
    rl = limits.RateLimiter(rate_per_s=2, burst=2, clock=lambda: now[0])
    assert [rl.acquire("p") for _ in range(2)] == [0.0, 0.0]
    assert rl.acquire("p") == pytest.approx(0.5)
    now[0] = 0.5
    assert rl.acquire("p") == 0.0
    assert rl.acquire("q") == 0.0


def test_api_limits_prompt_and_completion_caps():
    lim = limits.ApiLimits(max_prompt_tokens=10, max_completion_tokens=5)
    assert lim.prompt_error(10) is None and "at most 10" in lim.prompt_error(11)
    assert lim.clamp_completion(100) == 5 and lim.clamp_completion(3) == 3
    with pytest.raises(ValueError):
        limits.ApiLimits(max_concurrent_requests=0)
