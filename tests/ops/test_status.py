"""``ringlet status`` and the snapshot behind it: normalisation of ``/v1/cluster``
answers (today's fields and the members/links schema), polling over real HTTP,
client-side tokens/s, exit codes.

``FakeNode`` (a real HTTP server on 127.0.0.1 answering ``/v1/cluster`` from a
function) is also used by the dashboard and doctor tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ringlet

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.status.collector import Collector
from ringlet.daemon.ops.status.command import EXIT_DEGRADED, EXIT_OK, EXIT_UNREACHABLE, exit_status, format_status
from ringlet.daemon.ops.status.snapshot import build_snapshot
from ringlet.daemon.ops.status.urls import normalize_api_url

GIB = 1 << 30


class FakeNode:
    """A real HTTP server answering ``GET /v1/cluster`` with ``info()`` and ``/healthz``."""

    def __init__(self, info):
        self.info = info if callable(info) else (lambda: info)
        node = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                if self.path == "/v1/cluster":
                    body = json.dumps(node.info()).encode()
                elif self.path == "/healthz":
                    i = node.info()
                    body = json.dumps({"status": "ok", "state": i.get("state"), "node_id": i.get("node_id")}).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeNode:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def plan_of(n: int, layers: int = 30) -> list[dict]:
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return [{"address": f"127.0.0.1:{7100 + i}", "start": cuts[i], "end": cuts[i + 1]} for i in range(n)]


def today_info(i: int, n: int = 3, layers: int = 30, epoch: int = 1, state: str = "ready", **extra) -> dict:
    """``/v1/cluster`` of node ``i`` with the fields the spine serves today."""
    plan = plan_of(n, layers)
    info = {
        "node_id": plan[i]["address"], "address": plan[i]["address"], "state": state, "epoch": epoch,
        "model": "smollm2-135m", "num_layers": layers, "stage": i,
        "layer_range": [plan[i]["start"], plan[i]["end"]], "plan": plan,
        "requests_in_flight": 0, "kv_caches": [], "hop_latency_median_s": 0.0004 + i * 1e-5,
        "memory": {"rss_bytes": (280 + i) << 20, "weights_bytes": 54 << 20},
        "recent_requests": [],
    }
    info.update(extra)
    return info


def batching_of(mean: float | None, last: int, max_batch: int = 8, queued: int = 0, head: float = 0.0) -> dict:
    """``/v1/cluster``'s ``batching`` (a stage's decode batches and the tokens/s of the requests it heads)."""
    return {"max_batch": max_batch, "last_batch": last, "mean_batch_recent": mean,
            "histogram": {"1": 120, "2": 40, "3": 7}, "queued": queued, "prefill_chunk": 512,
            "head_tokens_per_s": head}


def batched_infos() -> dict[str, dict]:
    """Three stages serving three concurrent requests; stages 0 and 1 report batching and API
    admission, stage 2 is an older daemon that reports neither."""
    api = {"running": 3, "queued": 2, "max_concurrent_requests": 8, "max_queue": 32}
    return {
        "http://a0": today_info(0, state="serving", requests_in_flight=3, tokens_generated_total=400,
                                batching=batching_of(2.4, 3, queued=1, head=7.5), api=api, release="0.2.0",
                                protocol_version=1),
        "http://a1": today_info(1, state="serving", tokens_generated_total=0, release="0.2.0", protocol_version=1,
                                batching=batching_of(12.4, 12, max_batch=16),
                                api=dict(api, running=0, queued=0)),
        "http://a2": today_info(2, state="serving"),
    }


def studio_infos(n: int = 4) -> dict[str, dict]:
    """``{api_url: /v1/cluster}`` of four Mac Studios with the members/links schema."""
    names = [f"studio-{k + 1}" for k in range(n)]
    ids = [f"{k + 1:016x}" for k in range(n)]
    plan = [dict(p, node_id=ids[k]) for k, p in enumerate(plan_of(n, 80))]
    for k, p in enumerate(plan):
        p["address"] = f"10.0.0.{k + 1}:7100"
    members = [{
        "node_id": ids[k], "name": names[k], "chip": "Apple M3 Ultra", "state": "self" if k == 0 else "alive",
        "grpc_address": plan[k]["address"], "api_url": f"http://10.0.0.{k + 1}:8000",
        "memory_total_bytes": 512 * GIB, "memory_usable_bytes": 480 * GIB, "memory_used_bytes": (90 + k) * GIB,
        "layer_range": [plan[k]["start"], plan[k]["end"]],
    } for k in range(n)]
    links = [{"a": ids[k], "b": ids[(k + 1) % n], "kind": "thunderbolt", "bandwidth_bytes_per_s": 5e9,
              "rtt_s": 0.00021} for k in range(n)]
    base = {
        "node_id": ids[0], "address": plan[0]["address"], "state": "serving", "epoch": 7, "model": "Llama-3.3-70B",
        "num_layers": 80, "stage": 0, "layer_range": [0, 20], "plan": plan, "requests_in_flight": 1,
        "memory": {"rss_bytes": 90 * GIB}, "tokens_generated_total": 1234, "tokens_per_s": 31.5,
        "recent_requests": [{"request_id": "aaaa1111", "prompt_tokens": 12, "completion_tokens": 200,
                             "ttft_s": 0.41, "tokens_per_s": 30.2},
                            {"request_id": "bbbb2222", "prompt_tokens": 40, "completion_tokens": 64,
                             "ttft_s": 0.52, "tokens_per_s": 29.9}],
        "members": members, "links": links, "policy": "balanced", "mode": "pipeline",
        "negotiation": {"state": "idle", "proposer": ids[0]},
        "events": [{"ts": 1_700_000_000 + k, "kind": kind, "message": msg} for k, (kind, msg) in enumerate(
            [("join", "studio-4 joined"), ("replan", "epoch 7: moved 12.0 GB"), ("error", "request x failed")])],
    }
    return {"http://10.0.0.1:8000": base}


# --------------------------------------------------------------------------- normalise


def test_today_schema_ring_order_ranges_hops_and_idle_rate():
    infos = {f"http://a{i}": today_info(i, tokens_generated_total=10 if i == 0 else 0) for i in range(3)}
    infos["http://a0"]["recent_requests"] = [
        {"request_id": "old", "prompt_tokens": 4, "completion_tokens": 10, "ttft_s": 0.3, "tokens_per_s": 8.0},
        {"request_id": "new", "prompt_tokens": 5, "completion_tokens": 150, "ttft_s": 0.4, "tokens_per_s": 8.8}]
    snap = build_snapshot("http://a0", infos, {})
    assert snap["reachable"] and snap["healthy"]
    assert [n["layer_range"] for n in snap["nodes"]] == [[0, 10], [10, 20], [20, 30]]
    assert [n["api_url"] for n in snap["nodes"]] == ["http://a0", "http://a1", "http://a2"]
    assert snap["cluster"]["epoch"] == 1 and snap["cluster"]["num_layers"] == 30
    assert [h["returns"] for h in snap["hops"]] == [False, False, True]
    # the hop latency is the receiving stage's
    assert snap["hops"][0]["hop_latency_s"] == infos["http://a1"]["hop_latency_median_s"]
    assert [r["request_id"] for r in snap["recent_requests"]] == ["new", "old"]
    # counters known and nothing in flight: the ring runs at 0 tokens/s, said as such
    assert snap["cluster"]["tokens_per_s"] == 0.0
    assert all(n["tokens_per_s"] == 0.0 for n in snap["nodes"])
    assert snap["cluster"]["memory_used_bytes"] == sum((280 + i) << 20 for i in range(3))
    json.dumps(snap)  # JSON-safe


def test_members_links_schema():
    infos = studio_infos()
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    names = [n["name"] for n in snap["nodes"]]
    assert names == ["studio-1", "studio-2", "studio-3", "studio-4"]
    assert all(n["chip"] == "Apple M3 Ultra" for n in snap["nodes"])
    assert snap["cluster"]["memory_total_bytes"] == 4 * 512 * GIB
    assert snap["cluster"]["memory_usable_bytes"] == 4 * 480 * GIB
    assert snap["cluster"]["tokens_per_s"] == 31.5  # the cluster's own figure wins
    assert snap["cluster"]["policy"] == "balanced" and snap["cluster"]["mode"] == "pipeline"
    hop = snap["hops"][3]
    assert hop["returns"] and hop["kind"] == "thunderbolt" and hop["bandwidth_bytes_per_s"] == 5e9
    assert hop["rtt_s"] == 0.00021 and hop["to_name"] == "studio-1"
    # the other nodes' API URLs come from members; they were not polled
    assert snap["nodes"][1]["api_url"] == "http://10.0.0.2:8000" and snap["nodes"][1]["reachable"] is None
    assert [e["kind"] for e in snap["events"]] == ["join", "replan", "error"]


def test_member_verdict_suspect_and_nodes_outside_the_plan():
    infos = studio_infos()
    base = infos["http://10.0.0.1:8000"]
    base["members"][2]["state"] = "suspect"
    base["members"].append({"node_id": "f" * 16, "name": "mbp", "chip": "Apple M4 Max", "state": "alive",
                            "grpc_address": "10.0.0.9:7100", "api_url": None, "memory_total_bytes": 64 * GIB})
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    assert snap["nodes"][2]["state"] == "suspect"
    assert not snap["healthy"] and exit_status(snap) == EXIT_DEGRADED
    extra = snap["nodes"][-1]
    assert extra["name"] == "mbp" and not extra["in_plan"] and extra["stage"] is None
    assert snap["cluster"]["nodes"] == 4  # only plan stages count


def test_a_node_that_stops_answering_keeps_its_place_marked_unreachable():
    infos = {f"http://a{i}": today_info(i) for i in (0, 2)}
    errors = {"http://a1": "connection refused"}
    addresses = {"http://a1": "127.0.0.1:7101"}
    snap = build_snapshot("http://a0", infos, errors, addresses=addresses)
    mid = snap["nodes"][1]
    assert mid["address"] == "127.0.0.1:7101" and mid["state"] == "unreachable" and mid["reachable"] is False
    assert mid["error"] == "connection refused" and mid["layer_range"] == [10, 20]  # from the plan
    assert exit_status(snap) == EXIT_DEGRADED


def test_batch_figures_per_node_and_an_old_node_without_them():
    snap = build_snapshot("http://a0", batched_infos(), {})
    json.dumps(snap)
    n0, n1, old = snap["nodes"]
    assert (n0["batch_mean"], n0["batch_last"], n0["max_batch"], n0["stage_queued"], n0["api_queued"]) == (
        2.4, 3, 8, 1, 2)
    assert (n1["batch_mean"], n1["batch_last"], n1["max_batch"], n1["stage_queued"], n1["api_queued"]) == (
        12.4, 12, 16, 0, 0)
    assert n0["head_tokens_per_s"] == 7.5 and n1["head_tokens_per_s"] == 0.0
    for key in ("batch_mean", "batch_last", "max_batch", "stage_queued", "api_queued", "head_tokens_per_s"):
        assert old[key] is None, key
    # one snapshot, no counter rate yet, requests in flight: the heads' own aggregate figure
    assert snap["cluster"]["tokens_per_s"] == 7.5 and snap["cluster"]["requests_in_flight"] == 3
    assert format_status(snap) == (
        "model smollm2-135m · layers 30 · epoch 1 · policy — · nodes 3/3 ready · in flight 3 · tokens/s 7.5\n"
        "stage  node            version   state    layers   memory  tok/s  batch  compute  prefix  grpc            "
        "api\n"
        "0      127.0.0.1:7100  0.2.0/p1  serving  [0,10)   280MiB  7.5    2.4/8  —        —       127.0.0.1:7100  "
        "http://a0\n"
        "1      127.0.0.1:7101  0.2.0/p1  serving  [10,20)  281MiB  7.5    12/16  —        —       127.0.0.1:7101  "
        "http://a1\n"
        "2      127.0.0.1:7102  —         serving  [20,30)  282MiB  7.5    —      —        —       127.0.0.1:7102  "
        "http://a2\n")


def test_mixed_releases_in_the_rows_and_one_line():
    """A rolling upgrade under way: the members' releases (as /v1/cluster's members list gives
    them) in each row, and a line counting the nodes on each."""
    infos = studio_infos()
    members = infos["http://10.0.0.1:8000"]["members"]
    for k, m in enumerate(members):
        m.update(release="0.1.0" if k == 3 else "0.2.0", protocol_version=1)
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    assert [n["release"] for n in snap["nodes"]] == ["0.2.0", "0.2.0", "0.2.0", "0.1.0"]
    text = format_status(snap)
    rows = {line.split()[1]: line.split()[2] for line in text.splitlines() if line.startswith(("0 ", "1 ", "2 ", "3 "))}
    assert rows == {"studio-1": "0.2.0/p1", "studio-2": "0.2.0/p1", "studio-3": "0.2.0/p1", "studio-4": "0.1.0/p1"}
    assert ("releases: 0.2.0/p1 on 3 nodes, 0.1.0/p1 on 1 node (mixed: each plan uses only what every node "
            "taking part speaks)") in text.splitlines()


def test_prefix_store_figures_per_node_and_summed():
    """/v1/cluster's prefix_cache per node in the snapshot, summed for the cluster, and in
    status's prefix column (bytes held, hits/misses); a node without one shows a dash."""
    infos = batched_infos()
    urls = list(infos)
    infos[urls[0]]["prefix_cache"] = {"bytes": 10_629_120, "budget_bytes": 6 * 2**30, "entries": 1, "hits": 2,
                                      "misses": 1, "evictions": 0}
    infos[urls[1]]["prefix_cache"] = {"bytes": 2**20, "budget_bytes": 2**30, "entries": 3, "hits": 5, "misses": 0,
                                      "evictions": 4, "disk": {"bytes": 3 * 2**30, "entries": 7}}
    snap = build_snapshot("http://a0", infos, {})
    n0, n1, old = snap["nodes"]
    assert (n0["prefix_bytes"], n0["prefix_entries"], n0["prefix_hits"], n0["prefix_misses"]) == (10_629_120, 1, 2, 1)
    assert (n1["prefix_evictions"], old["prefix_bytes"]) == (4, None)
    assert (snap["cluster"]["prefix_bytes"], snap["cluster"]["prefix_hits"]) == (10_629_120 + 2**20, 7)
    assert (n1["prefix_disk_bytes"], n1["prefix_disk_entries"], n0["prefix_disk_bytes"]) == (3 * 2**30, 7, None)
    assert snap["cluster"]["prefix_disk_bytes"] == 3 * 2**30
    text = format_status(snap)
    assert "10.1MiB:2h/1m" in text and "1.0MiB+3.0GiBdisk:5h/0m" in text  # 10,629,120 B = 10.14 MiB


def test_the_last_re_plans_kv_migration_summed_over_the_nodes_that_saw_it():
    """Each node's ``kv_migration.last``; the status line sums the newest epoch's figures
    (an older epoch's report on another node is left out; an old node has none)."""
    infos = batched_infos()
    urls = list(infos)

    def last(epoch, received, sent, resumed=0, again=0, full=0, rebuilt=0, precopied=0):
        return {"kv_migration": {"last": {"epoch": epoch, "kv_bytes_received": received, "kv_bytes_sent": sent,
                                          "resumed": resumed, "reprefilled_tokens": again,
                                          "full_reprefills": full, "rebuilt_tokens": rebuilt,
                                          "precopied_bytes": precopied}}}

    infos[urls[0]].update(last(4, 3 * 2**20, 0, resumed=2, again=1, full=0, rebuilt=300, precopied=2**20))
    infos[urls[1]].update(last(4, 2**20, 4 * 2**20, rebuilt=34, precopied=2**20))
    snap = build_snapshot("http://a0", infos, {})
    assert snap["cluster"]["kv_migration"] == {"epoch": 4, "kv_bytes_received": 4 * 2**20, "kv_bytes_sent": 4 * 2**20,
                                               "resumed": 2, "reprefilled_tokens": 1, "full_reprefills": 0,
                                               "rebuilt_tokens": 334, "precopied_bytes": 2 * 2**20}
    assert ("re-plan to epoch 4: KV moved 6.0 MiB (2.0 MiB of it while preparing) · 2 request(s) resumed · "
            "334 token(s) of lost layers rebuilt · 1 token(s) prefilled again (0 full re-prefill(s))"
            ) in format_status(snap)
    infos[urls[1]].update(last(3, 9, 9))
    assert build_snapshot("http://a0", infos, {})["cluster"]["kv_migration"]["kv_bytes_received"] == 3 * 2**20
    assert build_snapshot("http://a0", batched_infos(), {})["cluster"]["kv_migration"] is None


def test_speculative_decoding_figures_summed_in_the_status_line():
    """/v1/cluster's ``speculation`` counters per node, summed; tokens per trip and the
    acceptance rate from the sums (hand computed: (30 + 10) / (12 + 4) = 2.5 tokens per
    trip, (18 + 6) / (40 + 20) = 40 %); no line when no node made a verifying trip."""
    infos = batched_infos()
    urls = list(infos)
    infos[urls[0]]["speculation"] = {"trips": 12, "tokens": 30, "drafted": 40, "accepted": 18}
    infos[urls[1]]["speculation"] = {"trips": 4, "tokens": 10, "drafted": 20, "accepted": 6}
    snap = build_snapshot("http://a0", infos, {})
    assert snap["cluster"]["speculation"] == {"trips": 16, "tokens": 40, "drafted": 60, "accepted": 24,
                                              "tokens_per_trip": 2.5, "acceptance": 0.4}
    assert ("speculative decoding: 2.50 tokens per trip · 40% of 60 drafted tokens accepted · 16 trips"
            in format_status(snap))
    assert build_snapshot("http://a0", batched_infos(), {})["cluster"]["speculation"] is None
    assert "speculative decoding" not in format_status(build_snapshot("http://a0", batched_infos(), {}))


def test_compute_column_and_the_fix_for_a_slow_path():
    """What each node computes on (its loaded dtype and BLAS, from /v1/cluster) and, for a
    node on MLX's reference BLAS or quantized weights on a CPU, one line with the fix."""
    infos = batched_infos()
    urls = list(infos)
    infos[urls[0]]["blas"] = {"kind": "optimized", "library": "/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                              "libopenblasp-r0.3.21.so", "threads": 2}
    infos[urls[0]]["dtype"] = {"requested": "auto", "loaded": "float32", "slow_path": False, "reason": "auto: ..."}
    infos[urls[1]]["blas"] = {"kind": "bundled", "reason": "RINGLET_BLAS=/x.so: no such file",
                              "fix": "apt-get install libopenblas0-pthread"}
    infos[urls[1]]["dtype"] = {"requested": "native", "loaded": "native", "slow_path": True,
                               "reason": "--dtype native: the model's own precision"}
    snap = build_snapshot("http://a0", infos, {})
    n0, n1, old = snap["nodes"]
    assert (n0["compute"], n0["compute_fix"]) == ("float32 · openblas", None)
    assert n1["compute"] == "native · reference BLAS"
    assert n1["compute_fix"] == "apt-get install libopenblas0-pthread; --dtype native: the model's own precision"
    assert (old["compute"], old["compute_fix"]) == (None, None)
    text = format_status(snap)
    assert "float32/openblas" in text and "native/reference-BLAS" in text
    assert "slow path on 127.0.0.1:7101: apt-get install libopenblas0-pthread; --dtype native" in text
    # an optimized BLAS whose matrix-vector products could not be sent to sgemv (no compiler)
    infos[urls[0]]["blas"]["gemv_fix"] = "apt-get install gcc (...)"
    n0 = build_snapshot("http://a0", infos, {})["nodes"][0]
    assert (n0["compute"], n0["compute_fix"]) == ("float32 · openblas", "apt-get install gcc (...)")


def test_batch_column_dash_when_idle_or_unknown():
    from ringlet.daemon.ops.format import fmt_batch

    assert fmt_batch(2.4, 8) == "2.4/8" and fmt_batch(1.0, 8) == "1.0/8" and fmt_batch(12.4, 16) == "12/16"
    assert fmt_batch(None, 8) == "—" and fmt_batch(None, None) == "—" and fmt_batch(3.0, None) == "3.0"
    infos = batched_infos()
    infos["http://a0"]["batching"]["mean_batch_recent"] = None  # no forward in the last 10 s
    infos["http://a1"]["batching"] = None  # a node without an engine yet
    snap = build_snapshot("http://a0", infos, {})
    assert [n["batch_mean"] for n in snap["nodes"]] == [None, None, None]
    assert snap["nodes"][0]["max_batch"] == 8 and snap["nodes"][1]["max_batch"] is None
    rows = format_status(snap).splitlines()[2:]
    assert [r.split()[7] for r in rows] == ["—", "—", "—"]


def test_ring_rate_is_the_sum_over_concurrent_requests_and_heads():
    """The ring's tokens/s counts every token of every request in flight: per node, the
    ``tokens_generated_total`` delta (one per token of each generation it heads), summed."""
    c = Collector(["http://x"])
    a, b = today_info(0, n=2), today_info(1, n=2)  # both head requests (each is some client's API node)
    c.rates({"http://a": dict(a, tokens_generated_total=100), "http://b": dict(b, tokens_generated_total=50)}, 100.0)
    rates, total = c.rates({"http://a": dict(a, tokens_generated_total=130),
                            "http://b": dict(b, tokens_generated_total=70)}, 102.0)
    assert rates == {"127.0.0.1:7100": 15.0, "127.0.0.1:7101": 10.0} and total == 25.0
    infos = batched_infos()
    # the counter rate wins over the heads' own (lagging, 10 s) figures
    assert build_snapshot("http://a0", infos, {}, cluster_rate=total)["cluster"]["tokens_per_s"] == 25.0
    # no counter rate: the sum of what each node says of the requests it heads
    infos["http://a1"]["batching"]["head_tokens_per_s"] = 2.5
    assert build_snapshot("http://a0", infos, {})["cluster"]["tokens_per_s"] == 10.0
    # nothing in flight: 0, whatever the 10 s window still remembers
    infos["http://a0"]["requests_in_flight"] = 0
    assert build_snapshot("http://a0", infos, {})["cluster"]["tokens_per_s"] == 0.0


def test_nothing_answers():
    snap = build_snapshot(None, {}, {"http://x": "connection refused"})
    assert not snap["reachable"] and "connection refused" in snap["error"]
    assert exit_status(snap) == EXIT_UNREACHABLE
    assert format_status(snap).startswith("unreachable:")
    assert "start one (ringlet run), wait a few seconds if it is starting" in format_status(snap)


@pytest.mark.parametrize("garbage", [
    {"plan": "nope", "epoch": "7", "num_layers": None, "memory": [], "recent_requests": {"a": 1}},
    {"plan": [{"address": 5}, {"address": "h:1", "start": "a", "end": None}], "members": [1, None, "x"],
     "links": "x", "events": [None, {"ts": "garbage"}], "layer_range": [1], "tokens_per_s": float("nan")},
    {"plan": [{"address": "h:1", "start": 0, "end": 3}], "address": "h:1", "state": 3, "loading_progress": 250},
    {"plan": [{"address": "h:1", "start": 0, "end": 3}], "address": "h:1", "batching": "8", "api": [1, 2]},
    {"plan": [{"address": "h:1", "start": 0, "end": 3}], "address": "h:1", "api": {"queued": "2"},
     "batching": {"mean_batch_recent": "2.4", "max_batch": True, "queued": None, "head_tokens_per_s": float("inf")}},
])
def test_garbage_fields_degrade_instead_of_raising(garbage):
    from rich.console import Console

    from ringlet.daemon.ops.dashboard.frame import render

    snap = build_snapshot("http://g", {"http://g": garbage}, {})
    json.dumps(snap)
    for width in (80, 160):
        console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(render(snap))
        assert "—" in console.export_text()
    format_status(snap)


def test_normalize_api_url():
    assert normalize_api_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_api_url(" https://h:1/ ") == "https://h:1"
    for bad in ("", "ftp://h", "http://", "http://h:99999", "http://h:0"):
        with pytest.raises(RingletError):
            normalize_api_url(bad)


# --------------------------------------------------------------------------- over HTTP


def test_collector_rates_from_the_counter_over_http():
    t0 = time.monotonic()

    def info():
        busy = time.monotonic() - t0 < 30
        return today_info(0, n=1, tokens_generated_total=int(50 * (time.monotonic() - t0)),
                          requests_in_flight=1 if busy else 0, state="serving")

    async def two():
        c = Collector([node.url])
        try:
            first = await c.snapshot()
            await asyncio.sleep(0.4)
            second = await c.snapshot()
        finally:
            await c.aclose()
        return first, second

    with FakeNode(info) as node:
        first, second = asyncio.run(two())
    assert first["cluster"]["tokens_per_s"] is None  # one sample, requests in flight: no rate yet
    rate = second["cluster"]["tokens_per_s"]
    assert 25 < rate < 80, rate
    assert second["nodes"][0]["tokens_per_s"] == rate


def test_collector_counter_restart_gives_no_negative_rate():
    c = Collector(["http://x"])
    info = today_info(0, n=1, tokens_generated_total=500)
    c.rates({"http://x": info}, 100.0)
    rates, total = c.rates({"http://x": dict(info, tokens_generated_total=3)}, 101.0)
    assert total is None or total >= 0


def test_collector_polls_members_it_learns_of():
    with FakeNode(lambda: today_info(1, n=2, state="loading", loading_progress=0.45)) as b:
        a_info = today_info(0, n=2)
        a_info["members"] = [{"node_id": "127.0.0.1:7100", "grpc_address": "127.0.0.1:7100", "state": "self"},
                             {"node_id": "127.0.0.1:7101", "grpc_address": "127.0.0.1:7101", "state": "alive",
                              "api_url": b.url, "name": "box-b"}]
        with FakeNode(a_info) as a:
            async def once():
                c = Collector([a.url])
                try:
                    return await c.snapshot()
                finally:
                    await c.aclose()

            snap = asyncio.run(once())
    nb = snap["nodes"][1]
    assert nb["name"] == "box-b" and nb["reachable"] is True
    assert nb["state"] == "loading" and nb["loading_progress"] == pytest.approx(0.45)


def test_status_cli_exit_codes_and_json():
    with FakeNode(today_info(0, n=1)) as ok, FakeNode(today_info(0, n=1, state="loading")) as loading:
        r = ringlet("status", "--api", ok.url, timeout=60)
        assert r.returncode == EXIT_OK, r.stderr
        assert "epoch 1" in r.stdout and "[0,30)" in r.stdout and "127.0.0.1:7100" in r.stdout
        r = ringlet("status", "--json", "--api", ok.url, timeout=60)
        snap = json.loads(r.stdout)
        assert snap["healthy"] and snap["nodes"][0]["layer_range"] == [0, 30]
        r = ringlet("status", "--api", loading.url, timeout=60)
        assert r.returncode == EXIT_DEGRADED and "loading" in r.stdout
    r = ringlet("status", "--api", ok.url, timeout=60)  # server gone
    assert r.returncode == EXIT_UNREACHABLE and "unreachable" in r.stdout
    for bad in (["--api", "ftp://x"], ["--timeout", "soon"]):
        r = ringlet("status", *bad, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().startswith("error:"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_member_bound_to_a_wildcard_is_polled_at_its_grpc_host():
    from ringlet.daemon.ops.status.urls import member_api_url

    assert member_api_url({"api_url": "http://0.0.0.0:8000", "grpc_address": "10.0.0.2:7100"}) == \
        "http://10.0.0.2:8000"
    assert member_api_url({"api_url": "http://[::]:8000", "grpc_address": "[fe80::2]:7100"}) == \
        "http://[fe80::2]:8000"
    assert member_api_url({"api_url": "http://studio-2.local:8000", "grpc_address": "x:1"}) == \
        "http://studio-2.local:8000"
    assert member_api_url({"api_url": "http://0.0.0.0:8000", "grpc_address": "0.0.0.0:7100"}) is None
    assert member_api_url({"api_url": None}) is None


def test_a_member_that_leaves_is_no_longer_polled():
    with FakeNode(today_info(1, n=2)) as b:
        a_info = today_info(0, n=2)
        a_info["members"] = [{"grpc_address": "127.0.0.1:7101", "api_url": b.url, "state": "alive"}]
        with FakeNode(lambda: a_info) as a:
            async def rounds():
                c = Collector([a.url])
                try:
                    first = await c.snapshot()
                    a_info["members"] = []
                    a_info["plan"] = a_info["plan"][:1]
                    await c.snapshot()  # the round that learns it left
                    second = await c.snapshot()
                    return first, second, list(c.discovered)
                finally:
                    await c.aclose()

            first, second, discovered = asyncio.run(rounds())
    assert first["nodes"][1]["reachable"] is True
    assert discovered == [] and second["error"] is None and len(second["nodes"]) == 1


def test_the_default_node_is_the_installed_services(tmp_path, monkeypatch):
    from ringlet.daemon.ops.status.urls import DEFAULT_API, default_api_url

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert default_api_url() == DEFAULT_API
    cdir = tmp_path / ".config" / "ringlet"
    cdir.mkdir(parents=True)
    (cdir / "service.toml").write_text('api_host = "0.0.0.0"\napi_port = 8123\n')
    assert default_api_url() == "http://127.0.0.1:8123"
    (cdir / "service.toml").write_text("api_port = [\n")  # broken: not this command's problem
    assert default_api_url() == DEFAULT_API


def tensor_infos() -> dict[str, dict]:
    """The four studios serving a tensor plan (ranks in ring order, rank 0 leads the group)."""
    infos = studio_infos()
    base = infos["http://10.0.0.1:8000"]
    ids = [s["node_id"] for s in base["plan"]]
    for s in base["plan"]:
        s.update(start=0, end=80)
    base.update(mode="tensor", plan_id="tensor:abc", tp={
        "requested": "auto", "mode": "tensor", "backend": "jaccl", "ranks": ids,
        "reason": "tensor: 4 ranks over jaccl (every pair has an RDMA Thunderbolt link)",
        "group": {"state": "ready", "epoch": 1, "size": 4, "plan_epoch": 7}})
    return infos


def test_tensor_mode_backend_and_ranks():
    infos = tensor_infos()
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    c = snap["cluster"]
    ids = [f"{k + 1:016x}" for k in range(4)]
    assert (c["mode"], c["backend"], c["ranks"], c["tensor_group"]) == ("tensor", "jaccl", ids, "ready")
    assert c["mode_reason"] == "tensor: 4 ranks over jaccl (every pair has an RDMA Thunderbolt link)"
    assert c["mode_refused"] is None
    assert [n["rank"] for n in snap["nodes"]] == [0, 1, 2, 3]
    assert exit_status(snap) == EXIT_OK
    text = format_status(snap)
    assert "mode tensor · backend jaccl · ranks 0 studio-1, 1 studio-2, 2 studio-3, 3 studio-4 · group ready" in text
    infos["http://10.0.0.1:8000"]["tp"]["group"]["state"] = "recovering"
    down = build_snapshot("http://10.0.0.1:8000", infos, {})
    assert down["cluster"]["tensor_group"] == "recovering" and exit_status(down) == EXIT_DEGRADED
    assert "why: tensor: 4 ranks over jaccl (every pair has an RDMA Thunderbolt link)" in text


def test_refused_tensor_mode_is_said():
    infos = studio_infos()
    why = "tensor mode refused: m: 9 attention heads do not divide by 4 ranks; group sizes that work: 3"
    infos["http://10.0.0.1:8000"]["tp"] = {"requested": "tensor", "mode": "pipeline", "backend": "none",
                                           "ranks": [], "refused": why, "reason": f"{why}; serving the pipeline"}
    snap = build_snapshot("http://10.0.0.1:8000", infos, {})
    c = snap["cluster"]
    assert (c["mode"], c["backend"], c["ranks"], c["mode_refused"]) == ("pipeline", "none", [], why)
    assert all(n["rank"] is None for n in snap["nodes"])
    text = format_status(snap)
    assert "mode pipeline\n" in text and f"why: {why}; serving the pipeline" in text


def hybrid_infos(second_group: str = "ready") -> dict[str, dict]:
    """The four studios serving a hybrid plan: 2 JACCL groups of 2, layers [0, 40) and [40, 80);
    the plan's stages are the groups' leaders (studio-1, studio-3), each reporting its group."""
    infos = studio_infos()
    base = infos["http://10.0.0.1:8000"]
    ids = [m["node_id"] for m in base["members"]]
    base["plan"] = [{"node_id": ids[0], "address": "10.0.0.1:7100", "start": 0, "end": 40},
                    {"node_id": ids[2], "address": "10.0.0.3:7100", "start": 40, "end": 80}]
    base.update(mode="hybrid", plan_id="hybrid:abc", layer_range=[0, 40], tp={
        "requested": "hybrid", "mode": "hybrid", "backend": "jaccl", "ranks": ids,
        "groups": [ids[:2], ids[2:]], "group_backends": ["jaccl", "jaccl"], "layer_ranges": [[0, 40], [40, 80]],
        "reason": "--mode hybrid: 2 groups of 2 over jaccl/jaccl",
        "group": {"state": "ready", "epoch": 1, "size": 2, "plan_epoch": 7, "layers": [0, 40]}})
    infos["http://10.0.0.3:8000"] = {
        "node_id": ids[2], "address": "10.0.0.3:7100", "state": "ready", "epoch": 7, "layer_range": [40, 80],
        "tp": {"mode": "hybrid", "group": {"state": second_group, "epoch": 2, "size": 2, "plan_epoch": 7,
                                           "layers": [40, 80]}}}
    return infos


def test_hybrid_groups_ranks_and_ranges():
    snap = build_snapshot("http://10.0.0.1:8000", hybrid_infos("recovering"), {})
    c = snap["cluster"]
    ids = [f"{k + 1:016x}" for k in range(4)]
    assert (c["mode"], c["backend"], c["tensor_group"]) == ("hybrid", "jaccl", "recovering")
    assert c["groups"] == [
        {"ranks": ids[:2], "layers": [0, 40], "backend": "jaccl", "state": "ready"},
        {"ranks": ids[2:], "layers": [40, 80], "backend": "jaccl", "state": "recovering"}]
    # every member is in the plan through its group: its stage, its rank in the group, its group's layers
    assert [(n["name"], n["stage"], n["rank"], n["layer_range"], n["in_plan"]) for n in snap["nodes"]] == [
        ("studio-1", 0, 0, [0, 40], True), ("studio-2", 0, 1, [0, 40], True),
        ("studio-3", 1, 0, [40, 80], True), ("studio-4", 1, 1, [40, 80], True)]
    assert exit_status(snap) == EXIT_DEGRADED  # a group that is not ready
    ok = build_snapshot("http://10.0.0.1:8000", hybrid_infos(), {})
    assert ok["cluster"]["tensor_group"] == "ready" and exit_status(ok) == EXIT_OK
    text = format_status(ok)
    assert ("mode hybrid · backend jaccl · groups [0,40) 0 studio-1, 1 studio-2 | [40,80) 0 studio-3, "
            "1 studio-4 · group ready") in text
    assert "why: --mode hybrid: 2 groups of 2 over jaccl/jaccl" in text


def test_a_download_in_progress_is_shown_with_bytes_rate_and_eta():
    download = {"what": "org/m layers [10, 20)", "file": "model-00002-of-00004.safetensors", "files_done": 0,
                "files_total": 2, "bytes_done": 250_000_000, "bytes_total": 1_000_000_000,
                "rate_bytes_per_s": 50_000_000.0, "eta_s": 15.0}
    infos = {f"http://a{i}": today_info(i, state="fetching" if i == 1 else "ready",
                                        download=download if i == 1 else None) for i in range(3)}
    snap = build_snapshot("http://a0", infos, {})
    assert snap["nodes"][1]["download"]["fraction"] == 0.25 and snap["nodes"][0]["download"] is None
    text = format_status(snap)
    # 250 MB of 1 GB, 50 MB/s = 400 Mb/s, 15 s left
    assert "downloading on 127.0.0.1:7101: model-00002-of-00004.safetensors · 238 MiB of 954 MiB · 400 Mb/s · " \
           "ETA 15.00 s" in text, text


def test_a_member_kept_out_for_its_revision_is_named():
    infos = {f"http://a{i}": today_info(i) for i in range(2)}
    infos["http://a0"]["negotiation"] = {"state": "idle", "kept_out": {"c" * 16: "org/m@" + "1" * 40}}
    text = format_status(build_snapshot("http://a0", infos, {}))
    assert f"kept out of the plan: {'c' * 16} serves org/m@{'1' * 40}, not the cluster's model" in text, text


def test_a_node_bound_to_every_interface_is_one_row_and_an_unreachable_plan_address_is_named():
    """Issue 18: a daemon bound to 0.0.0.0 reports that as its address, names itself at its
    advertised address (a private bridge here) and is in the plan at the address its peer
    reaches it at: one row per node, matched by id. A plan address a member cannot reach
    is a line naming it, from where and the flag, and the exit status is degraded."""
    ids = ["a" * 16, "b" * 16]
    plan = [{"node_id": ids[0], "address": "10.202.0.1:7100", "start": 0, "end": 16},
            {"node_id": ids[1], "address": "10.202.0.2:7100", "start": 16, "end": 30}]
    base = today_info(0, n=2)
    base.update(node_id=ids[0], address="0.0.0.0:7100", plan=plan, members=[
        {"node_id": ids[0], "state": "self", "grpc_address": "192.168.50.1:7100"},
        {"node_id": ids[1], "state": "alive", "grpc_address": "10.201.0.2:7100"}],
        routes=[{"from": ids[0], "to": ids[1], "address": "10.202.0.2:7100", "error": "DEADLINE_EXCEEDED",
                 "via": "10.201.0.2:7100", "in_plan": True, "fix": f"start {ids[1]} with --advertise-host A"}])
    snap = build_snapshot("http://a0", {"http://a0": base}, {})
    assert [(n["stage"], n["node_id"], n["address"]) for n in snap["nodes"]] == [
        (0, ids[0], "10.202.0.1:7100"), (1, ids[1], "10.202.0.2:7100")]
    assert snap["nodes"][0]["state"] == "ready"  # its own report, matched by id, not by 0.0.0.0
    text = format_status(snap)
    assert (f"unreachable: 10.202.0.2:7100 of bbbbbbbb (in the plan) from aaaaaaaa: DEADLINE_EXCEEDED; reached at "
            f"10.201.0.2:7100 instead (to pin an address: start {ids[1]} with --advertise-host A)") in text, text
    assert exit_status(snap) == EXIT_DEGRADED
    base["routes"][0]["in_plan"] = False  # the plan moved off it: informational, healthy
    assert exit_status(build_snapshot("http://a0", {"http://a0": base}, {})) == EXIT_OK


def test_prefilling_requests_in_snapshot_and_status():
    infos = {f"http://a{i}": today_info(i) for i in range(2)}
    infos["http://a0"]["prefilling"] = [{"request_id": "abcdef0123", "prompt_tokens": 3000, "cached_tokens": 256,
                                         "processed_tokens": 1280, "elapsed_s": 10.0, "eta_s": 13.5}]
    snap = build_snapshot("http://a0", infos, {})
    assert snap["prefilling"] == infos["http://a0"]["prefilling"]
    assert "prefilling abcdef01: 1280 of 3000 prompt tokens (256 cached) · ETA 13.50 s" in format_status(snap)
    assert build_snapshot(None, {}, {})["prefilling"] == []
