"""Network-namespace tests (issues 4, 5 and 18): real daemons, each in its own network
namespace on a bridge (see ``tests/netns.py``), real mDNS across the bridge, links
shaped with ``tbf`` and cut with ``ip link set ... down``.

Needs root and iproute2; skips with the reason otherwise. Nothing is sent on a real
interface: every address lives in namespaces the lab creates.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from netns import SUBNET, SUBNET2, NetnsLab, cleanup_stale, in_namespace, skip_reason, summarise
from streaming import Stream

_reason = skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(170)]

PROMPT = "Once upon a time"
LONG = 120  # tokens of the stream that is cut
GAP_LIVENESS_S = 15.0  # seconds; the goal of < 5 s is a benchmark figure
SHAPED_RATE = "100mbit"


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers():
    if _reason is None:
        removed = cleanup_stale()
        if removed:
            print(f"removed leftover namespaces of dead runs: {removed}")
    yield


@pytest.fixture
def lab():
    """A lab whose namespaces, veths, bridge and daemons are removed even on failure."""
    lab = NetnsLab()
    try:
        yield lab
    finally:
        lab.close()


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f} MB/s"


@contextlib.contextmanager
def _logs_on_failure(lab: NetnsLab, ref: subprocess.Popen | None = None) -> Iterator[None]:
    """Print the nodes' log tails when the block fails; stop ``ref`` (a :func:`_reference`
    run) if it still runs, whatever happened."""
    try:
        yield
    except BaseException:
        print(lab.dump_logs(40))
        raise
    finally:
        if ref is not None and ref.poll() is None:
            ref.kill()
            ref.wait()


# --------------------------------------------------------------------------- issue 4


def test_shaped_node_links_are_measured_slow(lab: NetnsLab):
    """4 nodes, node 3's veth pair shaped to 100 Mbit/s: every link measured to and from
    it is at most a quarter of every link among the others, and /v1/cluster marks
    exactly its links slow on every node."""
    # The quantized weights load in a fraction of the CPU time float32's dequantization
    # takes; links are measured while the stages load, and Python gRPC's throughput on
    # the unshaped links is bound by the CPU left over (2 cores, 4 daemons).
    nodes = [lab.add_node(["--dtype", "native"]) for _ in range(4)]
    shaped = nodes[3]
    lab.shape(shaped.index, rate=SHAPED_RATE)
    t0 = time.monotonic()
    with _logs_on_failure(lab):
        lab.start_nodes(nodes)
        healthy = time.monotonic() - t0

        views = lab.wait_converged(stages=None, timeout_s=90)
        # every node has measured its 3 peers, and every node holds every record (same graph everywhere)
        deadline = time.monotonic() + 60
        while True:
            records = lab.node_records(nodes)
            views = lab.views(nodes)
            graphs = {json.dumps(sorted((link["a"], link["b"], link["bandwidth_bytes_per_s"], link["slow"])
                                        for link in v["links"])) if isinstance(v, dict) else repr(v)
                      for v in views.values()}
            if (all(len(r["record"].get("links", {})) == 3 for r in records.values()) and len(graphs) == 1
                    and all(len(v["links"]) == 6 for v in views.values())):
                break
            assert time.monotonic() < deadline, (records, summarise(views))
            time.sleep(0.3)
        formed = time.monotonic() - t0
        index = {r["node_id"]: i for i, r in records.items()}

        # per direction, as each node measured it (a, b) = measured from a to b. Links are
        # first measured while the stages load; a CPU-starved first figure of an unshaped
        # link is measured again within LINK_REFRESH_S (30 s), so wait for one refresh.
        remeasure_by = time.monotonic() + 70
        while True:
            directed = {(i, index[b]): link["bandwidth_bytes_per_s"]
                        for i, r in records.items() for b, link in r["record"]["links"].items()}
            fast = [v for k, v in directed.items() if shaped.index not in k]
            slow = [v for k, v in directed.items() if shaped.index in k]
            if (fast and slow and max(slow) / min(fast) <= 0.25) or time.monotonic() > remeasure_by:
                break
            time.sleep(2)
            records = lab.node_records(nodes)
        rtts = {(i, index[b]): link["rtt_s"] for i, r in records.items() for b, link in r["record"]["links"].items()}
        touching = {k: v for k, v in directed.items() if shaped.index in k}
        others = {k: v for k, v in directed.items() if shaped.index not in k}
        print(f"\nhealthy after {healthy:.1f} s, cluster formed with all links measured after {formed:.1f} s")
        for k in sorted(directed):
            tag = "shaped" if shaped.index in k else "      "
            print(f"  {tag} {k[0]} -> {k[1]}: {_mb(directed[k])}, rtt {rtts[k] * 1e3:.2f} ms")
        assert len(touching) == 6 and len(others) == 6
        worst_ratio = max(touching.values()) / min(others.values())
        print(f"  fastest shaped {_mb(max(touching.values()))} / slowest unshaped {_mb(min(others.values()))}"
              f" = {worst_ratio:.3f}")
        assert worst_ratio <= 0.25, (touching, others)

        # the topology on every node: exactly the shaped node's 3 links are slow. The views
        # fetched above predate the re-measurement just waited for: fetch them again until
        # every node's graph has taken in the records read last (one record gossip round).
        shaped_id = views[shaped.index]["node_id"]
        expected = {frozenset((shaped_id, v2["node_id"])) for j, v2 in views.items() if j != shaped.index}
        deadline = time.monotonic() + 20
        while True:
            views = lab.views(nodes)
            slow = {i: {frozenset((link["a"], link["b"])) for link in v["links"] if link["slow"]}
                    for i, v in views.items()}
            if all(s == expected for s in slow.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for i, v in views.items():
            assert slow[i] == expected, (i, v["links"])


def test_two_daemons_on_one_machine_see_a_loopback_link_from_both_ends(lab: NetnsLab):
    """Nodes 0 and 1 share a network namespace (one machine, two addresses on one veth),
    node 2 has its own: on both ends and in every member's graph the 0-1 link is
    ``loopback`` (its traffic never leaves the machine) and the links to node 2 are
    ``ethernet``."""
    a = lab.add_node(["--dtype", "native"])
    b = lab.add_node(["--dtype", "native"], share_namespace_with=a)
    c = lab.add_node(["--dtype", "native"])
    nodes = [a, b, c]
    with _logs_on_failure(lab):
        lab.start_nodes(nodes)
        deadline = time.monotonic() + 90
        while True:
            records, views = lab.node_records(nodes), lab.views(nodes)
            if (all(len(r["record"].get("links", {})) == 2 for r in records.values())
                    and all(isinstance(v, dict) and len(v["links"]) == 3 for v in views.values())):
                break
            assert time.monotonic() < deadline, (records, summarise(views))
            time.sleep(0.5)
        ids = {i: r["node_id"] for i, r in records.items()}
        same_machine = frozenset((ids[a.index], ids[b.index]))
        # each end's own classification
        for i, r in records.items():
            for peer, link in r["record"]["links"].items():
                want = "loopback" if frozenset((ids[i], peer)) == same_machine else "ethernet"
                assert link["kind"] == want, (i, peer, link)
        # every member's graph
        for i, v in views.items():
            kinds = {frozenset((link["a"], link["b"])): link["kind"] for link in v["links"]}
            assert kinds == {k: "loopback" if k == same_machine else "ethernet" for k in kinds}, (i, kinds)


# --------------------------------------------------------------------------- issue 5 item 7


def _reference(max_tokens: int, *args: str) -> subprocess.Popen:
    """``ringlet generate`` (one process, no network; more options ``args``) for the
    undisturbed ids, started now."""
    return subprocess.Popen([sys.executable, "-m", "ringlet.daemon.ops.cli", "generate", "--json", *args,
                             "--max-tokens", str(max_tokens), PROMPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)




def _events(views: dict, kind: str, about: str, after: float) -> list[float]:
    """Wall times of the ``kind`` events mentioning ``about`` after ``after``, over ``views``."""
    return sorted(e["ts"] for v in views.values() if isinstance(v, dict) for e in v.get("events", [])
                  if e["kind"] == kind and about in e["message"] and e["ts"] >= after)


def test_cut_link_mid_stream_then_restore_rejoins(lab: NetnsLab):
    """3 nodes; a stream through a node that stays connected; the middle stage's veth
    is cut mid-stream: the stream completes with the undisturbed ids and no gap of
    5 s; the link is restored and the node rejoins without a restart."""
    ref = _reference(LONG)
    with _logs_on_failure(lab, ref):
        # a pipeline of 3 stages: auto mode may pick tensor parallelism on these links
        # (the tensor tests cover a lost rank), and then there is no middle stage to cut
        nodes = lab.start_all(3, args=["--mode", "pipeline"])
        views = lab.wait_converged(stages=3, timeout_s=90)
        out, err = ref.communicate(timeout=120)
        assert ref.returncode == 0, err
        expected = json.loads(out)["completion_ids"]
        assert len(expected) == LONG

        plan = views[0]["plan"]
        epoch_before = views[0]["epoch"]
        middle = lab.index_of(plan[1]["node_id"])
        middle_id = plan[1]["node_id"]
        api = next(d for d in nodes if d is not middle)
        others = [d for d in nodes if d is not middle]
        pids = {d.index: d.proc.pid for d in nodes}
        print(f"\nplan epoch {epoch_before}: {[(s['node_id'][:8], s['start'], s['end']) for s in plan]}; "
              f"cutting node {middle.index} ({middle.ip}, stage 1) on the switch side; "
              f"streaming through node {api.index}")

        stream = Stream(api.api_url, PROMPT, LONG, timeout_s=120, context=lambda: in_namespace(lab.hub))
        stream.wait_tokens(15, timeout_s=60)
        lab.cut(middle.index)
        cut_wall, cut_at = time.time(), time.monotonic()
        tokens_at_cut = len(stream.ids)
        stream.join(120)

        gaps = stream.gaps()
        longest = max(gaps, default=0.0)
        worst = gaps.index(longest) if gaps else 0
        after = lab.views(others)
        suspect = _events(after, "suspect", middle_id, cut_wall)
        left = _events(after, "leave", middle_id, cut_wall)
        replan = _events({api.index: after[api.index]}, "replan", "epoch", cut_wall)
        resumed = _events({api.index: after[api.index]}, "resume", "", cut_wall)

        def rel(ts: list[float]) -> str:
            return ", ".join(f"{t - cut_wall:.2f}" for t in ts) or "-"

        first_after = stream.times[worst + 1] - cut_at if len(stream.times) > worst + 1 else float("nan")
        print(f"cut after {tokens_at_cut} tokens; survivors marked it suspect at [{rel(suspect)}] s and dropped it "
              f"at [{rel(left)}] s; the API node committed the new plan at [{rel(replan)}] s and resumed the "
              f"request at [{rel(resumed)}] s; first token after the cut at {first_after:.2f} s")
        print(f"longest gap between tokens {longest:.2f} s (after token {worst}); "
              f"the stream ended {stream.times[-1] - cut_at if stream.times else float('nan'):.1f} s after the cut")
        # Every check is collected, so one run reports both the stream and the rejoin.
        problems = []
        if stream.error is not None:
            problems.append(f"the stream failed: {stream.error}")
        if len(left) != len(others):
            problems.append(f"the cut node was not dropped by every survivor: {summarise(after)}")
        if stream.finish != "length" or stream.ids != expected:
            first_diff = next((k for k, (a, b) in enumerate(zip(stream.ids, expected, strict=False)) if a != b),
                              min(len(stream.ids), len(expected)))
            problems.append(f"the stream differs from the undisturbed run from token {first_diff} "
                            f"({len(stream.ids)} tokens, finish {stream.finish!r})")
        if tokens_at_cut >= LONG:
            problems.append("the stream had ended before the cut")
        # Timing goals (gap < 5 s) are measured and reported by bench/, not asserted here
        # (a loaded CI box must not turn a speed figure into a red build); the test asserts
        # that the stream never stalls until the 30 s step timeout.
        if longest >= GAP_LIVENESS_S:
            problems.append(f"longest gap between tokens {longest:.2f} s (>= {GAP_LIVENESS_S} s): "
                            "the survivors dropped the cut "
                            f"node at [{rel(left)}] s, the API node committed the new plan at [{rel(replan)}] s, "
                            f"the first token after the cut came at {first_after:.2f} s")
        try:
            survivors = lab.wait_converged(others, stages=2, timeout_s=30)
            if next(iter(survivors.values()))["epoch"] <= epoch_before:
                problems.append("the survivors did not move to a newer epoch")
        except AssertionError as exc:
            problems.append(f"the survivors did not agree on a 2-stage plan: {exc}")
        if not middle.alive():
            problems.append(f"the cut node exited: {middle.tail()}")

        # restore the link: the node must rejoin by itself, without a restart
        lab.restore(middle.index)
        restored_at = time.monotonic()
        try:
            final = lab.wait_converged(nodes, stages=3, timeout_s=30)
        except AssertionError as exc:
            problems.append(
                f"the cut node did not rejoin within 30 s of its link coming back: {exc}")
        else:
            rejoin_s = time.monotonic() - restored_at
            first = next(iter(final.values()))
            print(f"rejoined: all 3 list 3 members on epoch {first['epoch']} with 3 stages {rejoin_s:.1f} s after "
                  f"the link came back")
            if {d.index: d.proc.pid for d in nodes} != pids:
                problems.append("a daemon was restarted")
            # and the cluster serves again, through the node that was cut
            resp = lab.post(middle, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                        "return_token_ids": True}, timeout=60)
            if resp.status_code != 200 or resp.json()["choices"][0]["token_ids"] != expected[:8]:
                problems.append(f"after the rejoin, node {middle.index} answered {resp.status_code}: {resp.text}")
        assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- issue 18


def test_hosts_with_docker_bridges_and_another_private_bridge_plan_on_addresses_that_route(lab: NetnsLab):
    """Three hosts as a user starts them (``--host 0.0.0.0``, no ``--interface``), each with
    Docker's ``docker0`` 172.17.0.1/16 made before its real link, and the first also with an
    unrelated bridge ``lan1`` 192.168.50.1/24 made first of all. Every stage address in the
    plan is on the hosts' shared subnet, completions through every node succeed with one
    answer, and ``doctor`` names docker0 as skipped."""
    docker = ("docker0", "172.17.0.1/16")
    nodes = [lab.add_node(["--mode", "pipeline"], bridges=(("lan1", "192.168.50.1/24"), docker) if i == 0
                          else (docker,), wildcard=True, link_name="eth0") for i in range(3)]
    lab.start_nodes(nodes)
    views = lab.wait_converged(nodes, stages=3, timeout_s=90)
    for i, view in views.items():
        hosts = [s["address"].rsplit(":", 1)[0] for s in view["plan"]]
        assert sorted(hosts) == sorted(d.ip for d in nodes), (i, view["plan"])
    answers = []
    for d in nodes:
        resp = lab.post(d, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                                                "return_token_ids": True}, timeout=120)
        assert resp.status_code == 200, (d.index, resp.text)
        answers.append(resp.json()["choices"][0]["token_ids"])
    assert len(answers[0]) == 6 and answers.count(answers[0]) == 3, answers
    log = nodes[1].log_path.read_text()
    assert "not advertising docker0 (172.17.0.1): a Docker bridge" in log, log[-2000:]
    doctor = subprocess.run(["ip", "netns", "exec", nodes[0].ns, sys.executable, "-m", "ringlet.daemon.ops.cli",
                             "doctor", "--api-port", "8001", "--port", "7101"], capture_output=True, text=True,
                            timeout=120)
    out = " ".join(doctor.stdout.split())
    assert "skips docker0 (172.17.0.1: a Docker bridge)" in out, doctor.stdout + doctor.stderr


def test_a_route_deleted_after_commit_moves_the_plan_to_an_address_that_works(lab: NetnsLab):
    """Two hosts as a user starts them (``--host 0.0.0.0``, no ``--interface``), each on two
    networks (eth0 on 10.201.0.0/24, eth1 on 10.202.0.0/24) and holding, made before both,
    docker0 172.17.0.1 and a private bridge lan1 192.168.50.1 that the other host holds too;
    at 80 MB each, the model needs both.

    1. No plan names an address both hosts hold.
    2. A network the plan runs on is shaped to 40 Mbit/s: the members measure the other
       one faster and re-plan on it (the measured fastest link is preferred).
    3. Mid-stream, host 1's route to that network is deleted. The stream through host 0
       ends with the undisturbed ids and no gap near the 30 s token timeout; host 1 is never
       removed; the next epoch stands on the addresses that work; ``/v1/cluster``,
       ``ringlet status`` and ``ringlet doctor`` (on host 0) name the dead address, from
       where, and the flag that pins one.
    4. Mid-stream, host 1's last route goes too: the stream fails well before the 30 s
       token timeout, with an error naming the address host 1 was last dialled at."""
    tokens = 40
    ref = _reference(tokens, "--dtype", "native")  # 190 MB nodes keep the Q4 weights
    both = (("lan1", "192.168.50.1/24"), ("docker0", "172.17.0.1/16"))
    args = ["--mode", "pipeline", "--memory-limit", "190MB", "--context", "512", "--link-refresh-s", "3"]
    nodes = [lab.add_node(args, bridges=both, wildcard=True, link_name="eth0") for _ in range(2)]
    for d in nodes:
        lab.add_link(d, "eth1")
    api, victim = nodes

    def subnets(views: dict) -> set[str]:
        """The networks of every stage address (and hop address) of every view."""
        return {a.rsplit(".", 1)[0] for v in views.values() for s in v["plan"]
                for a in (s["address"], s.get("hop_address") or s["address"])}

    def at(d, subnet: str) -> str:
        return f"{d.ip if subnet == SUBNET else d.ip2}:7100"

    with _logs_on_failure(lab, ref):
        lab.start_nodes(nodes)
        views = lab.wait_converged(nodes, stages=2, timeout_s=90)
        assert subnets(views) <= {SUBNET, SUBNET2}, views[0]["plan"]  # neither lan1 nor docker0
        ids = {d.index: views[d.index]["node_id"] for d in nodes}

        # 2. a network the plan uses becomes slow: the members move to the other one
        first = SUBNET if SUBNET in subnets(views) else SUBNET2
        fast = SUBNET2 if first == SUBNET else SUBNET
        for d in nodes:
            lab.shape(d.index, rate="40mbit", second=first == SUBNET2)
        shaped_at = time.monotonic()
        views = lab.wait_converged(nodes, stages=2, timeout_s=60, min_epoch=views[0]["epoch"] + 1,
                                   extra=lambda vs: subnets(vs) == {fast})
        print(f"\nplan on {first}.0/24; shaped it to 40 Mbit/s; re-planned on {fast}.0/24 after "
              f"{time.monotonic() - shaped_at:.1f} s (epoch {views[0]['epoch']})")
        out, err = ref.communicate(timeout=120)
        assert ref.returncode == 0, err
        expected = json.loads(out)["completion_ids"]

        # 3. host 1's route to that network goes away mid-stream
        epoch_before = views[0]["epoch"]
        stream = Stream(api.api_url, PROMPT, tokens, timeout_s=120, context=lambda: in_namespace(lab.hub))
        stream.wait_tokens(10, timeout_s=60)
        cut_wall, cut_at = time.time(), time.monotonic()
        lab.drop_route(victim, fast)
        victim.api_ip = at(victim, first).rsplit(":", 1)[0]  # the test's own way to its API
        stream.join(120)
        views = lab.wait_converged(nodes, stages=2, timeout_s=30, min_epoch=epoch_before + 1,
                                   extra=lambda vs: subnets(vs) == {first})
        moved = _events(views, "route", "", cut_wall)
        print(f"route deleted after 10 tokens; moved to {first}.0/24 after "
              f"[{', '.join(f'{t - cut_wall:.2f}' for t in moved)}] s; longest gap {stream.max_gap_s:.2f} s; "
              f"the stream ended {stream.times[-1] - cut_at:.1f} s after the cut (epoch {views[0]['epoch']})")
        assert stream.error is None, stream.error
        assert stream.finish == "length" and stream.ids == expected, (stream.ids, expected)
        assert stream.max_gap_s < GAP_LIVENESS_S, stream.gaps()
        assert not _events(views, "leave", "", cut_wall), summarise(views)  # reached elsewhere, never removed
        assert moved, [v["events"] for v in views.values()]

        dead = at(victim, fast)
        entry = next((e for e in views[api.index]["routes"] if e["address"] == dead and e["from"] == ids[api.index]),
                     None)
        assert entry is not None, views[api.index]["routes"]
        assert (entry["to"], entry["via"], entry["in_plan"], entry["broke"]) == (
            ids[victim.index], at(victim, first), False, True), entry
        assert "--advertise-host" in entry["fix"] and "--interface" in entry["fix"], entry
        for v in views.values():  # 1. the address both hold is no route: in no plan, route or member address
            peers = [m["grpc_address"] for m in v["members"] if m["state"] != "self"]
            assert "192.168.50.1" not in json.dumps([v["plan"], v["routes"], peers]), (v["plan"], v["routes"], peers)
        status = sh_status(lab, api)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"unreachable: {dead} of {ids[victim.index][:8]} from {ids[api.index][:8]}: stopped answering (" \
            in status.stdout, status.stdout
        doctor = subprocess.run(["ip", "netns", "exec", api.ns, sys.executable, "-m", "ringlet.daemon.ops.cli",
                                 "doctor", "--json"], capture_output=True, text=True, timeout=120)
        daemon_check = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "daemon")
        assert daemon_check["status"] == "WARN", daemon_check  # reached at another address: not in the plan
        assert f"{dead} of {ids[victim.index][:8]} from {ids[api.index][:8]}" in daemon_check["summary"], daemon_check
        assert "--advertise-host" in daemon_check["fix"], daemon_check

        # 4. no address of host 1 works any more: a clear error, not a 30 s wait
        stream = Stream(api.api_url, PROMPT, tokens, timeout_s=120, context=lambda: in_namespace(lab.hub))
        stream.wait_tokens(5, timeout_s=60)
        cut_at = time.monotonic()
        lab.drop_route(victim, first)
        stream.join(60)
        ended = time.monotonic() - cut_at
        print(f"host 1's last route deleted after 5 tokens: the stream ended {ended:.1f} s later: {stream.error}")
        assert stream.error is not None and at(victim, first) in stream.error, (stream.error, stream.finish)
        assert ended < 20, stream.error


def sh_status(lab: NetnsLab, d) -> subprocess.CompletedProcess:
    """``ringlet status --api`` of daemon ``d``, run in the hub namespace."""
    return subprocess.run(["ip", "netns", "exec", lab.hub, sys.executable, "-m", "ringlet.daemon.ops.cli", "status",
                           "--api", d.api_url], capture_output=True, text=True, timeout=60)
