"""Issue 7 acceptance with real daemons on loopback: two share a cluster secret, a third has
a wrong one; API key with the official ``openai`` client; a loopback capture; hostile
tensors and API fuzzing (schemathesis on the API's own OpenAPI schema); and after all of
that, a correct greedy completion.

One dynamic cluster (discovery + negotiation, dtype float32) serves the whole module;
the tests run in file order and the last one checks the daemons are still correct.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
import time

import grpc
import httpx
import openai
import pytest
from conftest import REFERENCE, ringlet
from hypothesis import HealthCheck, settings

from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.wire import auth, transport
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

pytest.importorskip("cryptography", reason="TLS needs the cryptography package")
from test_security import METHODS, SERVICE, Counting, call, path_of, tls_only_channel  # noqa: E402

from ringlet.daemon.wire.tls import cluster_tls  # noqa: E402

try:
    import schemathesis
except ImportError:  # pragma: no cover - the test extra should install it
    schemathesis = None

CHAT = next(c for c in REFERENCE if "messages" in c)
RAW = next(c for c in REFERENCE if "raw" in c)
API_KEY = "rk-" + "7" * 40
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_COMPLETION = 8  # node 1's cap: the chat reference ends (EOS) at token 8
FUZZ_COMPLETION, FUZZ_PROMPT = 2, 64  # node 0's caps: it is the fuzz target, so its generations stay short
#: Fuzzing-phase examples per API operation.
FUZZ_EXAMPLES = int(os.environ.get("RINGLET_FUZZ_EXAMPLES", "10"))
#: schemathesis phases. Its "coverage" phase (boundary values of every field, ~350 requests,
#: ~15 real generations) takes about a minute on two busy cores: opt in with
#: RINGLET_FUZZ_PHASES=examples,coverage,fuzzing.
FUZZ_PHASES = os.environ.get("RINGLET_FUZZ_PHASES", "examples,fuzzing").split(",")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secured")
    a = auth.write_secret(d / "a.secret")
    b = auth.write_secret(d / "b.secret")
    keys = d / "api.keys"
    keys.write_text(API_KEY + "\n")
    keys.chmod(0o600)
    common = ["--secret-file", str(a), "--api-key-file", str(keys)]
    c = LocalCluster(2, dtype="float32", dynamic=True, extra_args=common,
                     per_node_args=[["--max-completion-tokens", str(FUZZ_COMPLETION), "--max-prompt-tokens",
                                     str(FUZZ_PROMPT)], ["--max-completion-tokens", str(MAX_COMPLETION)]])
    c.api_headers = dict(AUTH)
    c.key_file = keys
    with c:
        c.secret, c.wrong, c.wrong_file = auth.load_secret(a), auth.load_secret(b), b
        yield c


def members(cluster: LocalCluster, i: int) -> set[str]:
    return {m["node_id"] for m in cluster.cluster_info(i)["members"]}


def grpc_addresses(cluster: LocalCluster) -> list[str]:
    return [f"127.0.0.1:{cluster.grpc_ports[i]}" for i in range(2)]


# --------------------------------------------------------------------------- wrong secret


def test_node_with_a_wrong_secret_is_never_a_member(secured):
    ours = {secured.cluster_info(i)["node_id"] for i in range(2)}
    assert members(secured, 0) == members(secured, 1) == ours
    before = secured.cluster_info(0)
    # Same cluster name, wrong secret, and it dials both members directly (--peers), so
    # more than mDNS is tried: its gRPC handshakes must fail too.
    w = secured.add_node(["--secret-file", str(secured.wrong_file), "--peers", ",".join(grpc_addresses(secured))])
    try:
        stranger = secured.cluster_info(w)["node_id"]
        time.sleep(3.0)  # several heartbeats, dial attempts and mDNS rounds
        for i in range(2):
            assert stranger not in members(secured, i)
        assert members(secured, w) == {stranger}
        after = secured.cluster_info(0)
        assert (after["epoch"], after.get("plan_id")) == (before["epoch"], before.get("plan_id"))
        assert "signature does not verify" in "\n".join(secured.tail(i, 200) for i in range(2))
    finally:
        secured.kill(w)


def test_every_method_of_every_member_refuses_the_wrong_secret(secured):
    """Enumerated from the generated descriptor: a method added later is covered too."""
    before = [secured.cluster_info(i) for i in range(2)]

    async def main():
        forged = auth.TokenSigner(secured.wrong, "intruder")
        ca = cluster_tls(secured.secret).ca_pem  # public: sent in every TLS handshake
        for address in grpc_addresses(secured):
            async with tls_only_channel(address, ca) as ch:
                for m in METHODS:
                    md = ((auth.AUTH_METADATA_KEY, forged.token(path_of(m))),)
                    assert await call(ch, m, md) == grpc.StatusCode.UNAUTHENTICATED, (address, m.name)
                    assert await call(ch, m) == grpc.StatusCode.UNAUTHENTICATED, (address, m.name)
            # the wrong-secret node's own transport: it does not trust the members at all
            async with transport.make_channel(transport.TransportConfig(secret=secured.wrong), address) as ch:
                for m in METHODS:
                    assert await call(ch, m, timeout=5) == grpc.StatusCode.UNAVAILABLE, (address, m.name)
            async with transport.make_channel(transport.TransportConfig(), address) as ch:  # no secret at all
                assert await call(ch, SERVICE.methods_by_name["GetNodeInfo"], timeout=5) == \
                    grpc.StatusCode.UNAVAILABLE

    import asyncio

    asyncio.run(main())
    after = [secured.cluster_info(i) for i in range(2)]
    for b, a in zip(before, after, strict=True):
        assert (a["epoch"], a.get("plan_id"), a["requests_in_flight"], a["kv_caches"]) == \
            (b["epoch"], b.get("plan_id"), 0, [])
        assert {m["node_id"] for m in a["members"]} == {m["node_id"] for m in b["members"]}


# --------------------------------------------------------------------------- capture


class LoopbackTap:
    """Every TCP payload on ``lo``, by port (a raw AF_PACKET socket: what tcpdump sees)."""

    def __init__(self):
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
            self.sock.bind(("lo", 0))
        except (AttributeError, PermissionError, OSError) as exc:
            pytest.skip(f"a loopback capture needs AF_PACKET and CAP_NET_RAW (Linux, root): {exc}")
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.settimeout(0.1)
        self.by_port: dict[int, bytearray] = collections.defaultdict(bytearray)
        self.packets = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoopbackTap:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(1 << 17)
            except TimeoutError:
                continue
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":
                continue
            ip = frame[14:]
            ihl, total = (ip[0] & 15) * 4, struct.unpack("!H", ip[2:4])[0]
            if ip[9] != 6:
                continue
            tcp = ip[ihl:total]
            sport, dport = struct.unpack("!HH", tcp[:4])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                self.packets += 1
                self.by_port[sport] += payload
                self.by_port[dport] += payload

    def seen(self, ports) -> bytes:
        return b"".join(bytes(self.by_port[p]) for p in ports)


def test_capture_on_loopback_shows_no_prompt_text_on_the_grpc_plane(secured):
    marker = "ZEBRA-QUOKKA-PLAINTEXT-MARKER"
    prompt = f"Repeat after me: {marker}. Then say something about zebras and quokkas."
    packed = pb.GenerateRequest(prompt=list(range(600, 612))).SerializeToString()[2:]
    with LoopbackTap() as tap:
        # positive control: the tap does see gRPC payloads in clear when there is no secret
        async def control():
            srv = Counting(transport.TransportConfig())
            await srv.server.start()
            try:
                async with transport.make_channel(transport.TransportConfig(), srv.address) as ch:
                    ping = pb.Ping(payload=marker.encode() + packed)
                    assert await call(ch, SERVICE.methods_by_name["Echo"], request=ping) == grpc.StatusCode.OK
            finally:
                await srv.server.stop(0)
            return srv.port

        import asyncio

        open_port = asyncio.run(control())
        # the real thing: a request through node 1's API; the prompt travels on as token
        # ids (Generate to stage 0) and hidden states (Hop) between the daemons
        r = httpx.post(f"{secured.api_urls[1]}/v1/completions", headers=AUTH, timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["prompt_token_ids"]
    grpc_bytes = tap.seen(secured.grpc_ports[:2])
    api_bytes = tap.seen(secured.api_ports[1:2])
    assert marker.encode() in tap.seen([open_port]) and packed in tap.seen([open_port]), "the tap sees nothing"
    assert marker.encode() in api_bytes  # the HTTP API is plain HTTP (see docs/security.md)
    assert len(grpc_bytes) > 4096, f"no gRPC traffic captured ({len(grpc_bytes)} bytes)"
    assert marker.encode() not in grpc_bytes
    assert b"zebras" not in grpc_bytes
    ids_packed = pb.GenerateRequest(prompt=ids).SerializeToString()
    assert ids_packed[2:] not in grpc_bytes  # the prompt's token ids, as the wire would carry them
    assert b"\x17\x03\x03" in grpc_bytes  # TLS application-data records


# --------------------------------------------------------------------------- API key and limits


def test_openai_client_wrong_key_401_right_key_works(secured):
    url = f"{secured.api_urls[1]}/v1"
    for key in ("wrong-" + "x" * 30, ""):
        client = openai.OpenAI(base_url=url, api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="smollm2-135m", messages=CHAT["messages"], max_tokens=4)
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    resp = client.chat.completions.create(model="smollm2-135m", messages=CHAT["messages"], max_tokens=30,
                                          temperature=0)
    assert resp.choices[0].message.content == CHAT["completion_text"]
    assert httpx.get(f"{secured.api_urls[1]}/healthz").status_code == 200  # open without a key


def test_api_limits_and_hostile_bodies(secured):
    url = f"{secured.api_urls[0]}/v1/completions"

    def post(body, **kw):
        return httpx.post(url, headers=AUTH, json=body, timeout=120, **kw)

    r = post({"prompt": "word " * (FUZZ_PROMPT + 50), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post({"prompt": list(range(1, 2 * FUZZ_PROMPT))})
    assert r.status_code == 400
    r = post({"prompt": "Hi", "max_tokens": 10**12, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= FUZZ_COMPLETION
    for bad in ({"prompt": "Hi", "max_tokens": "5"}, {"prompt": "Hi", "max_tokens": -1},
                {"prompt": "Hi", "temperature": 3}, {"prompt": "Hi", "stream": "yes"},
                {"prompt": "Hi", "stop": ["x"] * 100}, {"prompt": "Hi", "model": "gpt-4"},
                {"prompt": 5}, {"prompt": "Hi", "n": 1.5}):
        r = post(bad)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (bad, r.text)
    # accepted and harmless: a top_k beyond the vocabulary (once broke MLX's sampler for
    # every later request), a seed outside uint64
    for body in ({"prompt": "Hi", "max_tokens": 2, "top_k": 28717445, "temperature": 1.0},
                 {"prompt": "Hi", "max_tokens": 2, "seed": -1, "temperature": 1.0},
                 {"prompt": "Hi", "max_tokens": 2, "seed": 2**70, "temperature": 1.0}):
        assert post(body).status_code == 200
    r = httpx.post(url, headers={**AUTH, "content-type": "application/json"}, timeout=30,
                   content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413


# --------------------------------------------------------------------------- hostile input


def test_hostile_tensors_fail_the_request_not_the_node(secured):
    """Authenticated (a buggy or compromised member): malformed hidden states on Hop."""
    info = secured.cluster_info(0)
    target = next(s for s in info["plan"] if s["start"] > 0)  # a stage that takes hidden states
    good = dict(dtype="float32", shape=[1, 2, 576])
    hostile = [
        pb.Tensor(**good, data=b"\0" * 7),  # bytes != dtype x shape
        pb.Tensor(dtype="float8_e9", shape=[1, 1, 576], data=b"\0" * 576),  # unknown dtype
        pb.Tensor(dtype="float32", shape=[1, 1, 576], data=struct.pack("<f", float("nan")) * 576),
        pb.Tensor(dtype="float32", shape=[1 << 30, 1 << 30, 576], data=b""),  # absurd size
        pb.Tensor(dtype="float32", shape=[-1, 2, 576], data=b""),
        pb.Tensor(dtype="float32", shape=[1] * 20, data=b"\0" * 4),
    ]

    async def main():
        async with transport.make_channel(transport.TransportConfig(secret=secured.secret),
                                          target["address"]) as ch:
            hop = SERVICE.methods_by_name["Hop"]
            for i, tensor in enumerate(hostile):
                msg = pb.Activation(request_id=f"hostile-{i}", epoch=info["epoch"], step=0, offset=0,
                                    hidden=tensor, stage=1)
                code = await call(ch, hop, request=msg)
                assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK), (i, code)

    import asyncio

    asyncio.run(main())
    assert all(secured.procs[i].poll() is None for i in range(2))
    assert secured.cluster_info(0)["kv_caches"] == []


def local_openapi() -> dict:
    """The API's OpenAPI document, built in process (pytest 9 cannot load a schema lazily
    from a fixture with schemathesis 4); a test checks it equals the daemon's /openapi.json."""
    from types import SimpleNamespace

    from ringlet.daemon.api.app import create_app
    from ringlet.daemon.api.tokenizer import LazyTokenizer
    from ringlet.daemon.wire.limits import ApiLimits

    tokenizer = LazyTokenizer(lambda: SimpleNamespace(eos_token_ids=[2]))
    app = create_app(None, tokenizer, "smollm2-135m", 8192, limits=ApiLimits(api_key_digests=(b"k" * 32,)))
    return app.openapi()


def test_fuzzed_schema_is_the_daemons_own(secured):
    served = httpx.get(f"{secured.api_urls[0]}/openapi.json", timeout=10).json()
    assert served == local_openapi()
    assert served["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


if schemathesis is not None:
    api = schemathesis.openapi.from_dict(local_openapi())
    api.config.phases.update(phases=FUZZ_PHASES)

    @api.parametrize()
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def test_api_fuzz_no_5xx_no_schema_violation(case, secured):
        """Every check but positive_data_acceptance: a body valid by the schema may still be
        refused on meaning (an empty prompt, a chat template that rejects a message), with a
        documented 400."""
        case.call_and_validate(base_url=secured.api_urls[0], headers=AUTH, timeout=120,
                               excluded_checks=[schemathesis.checks.positive_data_acceptance])
else:  # pragma: no cover
    def test_api_fuzz_no_5xx_no_schema_violation():
        pytest.skip("schemathesis is not installed (pip install schemathesis)")


def test_still_serves_a_correct_greedy_completion(secured):
    assert all(secured.procs[i].poll() is None for i in range(2))
    for url, cap in zip(secured.api_urls[:2], (FUZZ_COMPLETION, MAX_COMPLETION), strict=True):
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120, json={
            "prompt": RAW["raw"], "max_tokens": 40, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == RAW["prompt_ids"]
        assert choice["token_ids"] == RAW["completion_ids"][:cap]
    client = openai.OpenAI(base_url=f"{secured.api_urls[1]}/v1", api_key=API_KEY, max_retries=0)
    resp = client.chat.completions.create(model="smollm2-135m", messages=CHAT["messages"], max_tokens=30,
                                          temperature=0)
    assert resp.choices[0].message.content == CHAT["completion_text"]


def test_cli_clients_send_the_api_key(secured, monkeypatch):
    """ringlet chat / status / dashboard read /v1/* of nodes run with --api-key-file: the
    first key of --api-key-file, else $RINGLET_API_KEY; without one they say 401, in one line."""
    url, keys = secured.api_urls[1], str(secured.key_file)
    monkeypatch.delenv("RINGLET_API_KEY", raising=False)
    bare = ringlet("status", "--api", url, timeout=60)
    assert bare.returncode == 1 and "401" in bare.stdout, bare.stdout + bare.stderr
    for args, env in ((["--api-key-file", keys], None), ([], API_KEY)):
        if env:
            monkeypatch.setenv("RINGLET_API_KEY", env)
        status = ringlet("status", "--api", url, *args, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "nodes 2/2 ready" in status.stdout
        frame = ringlet("dashboard", "--once", "--api", url, *args, timeout=60)
        assert frame.returncode == 0 and "unreachable" not in frame.stdout, frame.stdout
    monkeypatch.delenv("RINGLET_API_KEY")
    question = CHAT["messages"][-1]["content"]
    denied = ringlet("chat", "--api", url, question, timeout=120)
    assert denied.returncode == 2 and denied.stderr.strip().splitlines() == [
        f"error: {url} answered 401: Incorrect or missing API key: send 'Authorization: Bearer <key>'"]
    chat = ringlet("chat", "--api", url, "--api-key-file", keys, "--max-tokens", "30", question, timeout=120)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == CHAT["completion_text"]
