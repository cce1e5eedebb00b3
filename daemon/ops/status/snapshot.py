"""The cluster snapshot: :func:`build_snapshot` merges nodes' ``/v1/cluster`` answers
into one JSON-safe dict, in ring (plan) order (pure). Every field of ``/v1/cluster``
is optional: what a node does not report is ``None`` and drawn as "—".

Snapshot schema (all sizes in bytes, times in seconds, rates per second)::

    {"source": primary URL, "taken_at": unix s, "reachable": bool, "error": str|None,
     "healthy": bool,                       # reachable, every plan stage ready/serving, tensor group ready,
                                            # no plan address unreachable from a member,
                                            # every model serving (several models)
     "cluster": {"model", "num_layers", "epoch", "policy", "mode", "backend",
                 "ranks" [node ids, rank order; empty unless tensor or hybrid], "mode_reason",
                 "mode_refused" (why --mode tensor/hybrid could not run, or None),
                 "tensor_group" (the leader's group state, or None; hybrid: "ready" when
                 every group is, else the first other state), "groups" (hybrid: [{"ranks",
                 "layers" [start, end), "backend", "state"}] in stage order, else []),
                 "negotiation", "routes" (every address a member could not reach: [{"from", "to",
                 "address", "error", "via" (the address used instead, or None), "in_plan", "fix"}]),
                 "incompatible" (nodes kept out for another wire protocol version: [{"node_id",
                 "address", "release", "protocol_version", "reason"}]),
                 "nodes", "nodes_ready", "requests_in_flight", "tokens_per_s",
                 "tokens_generated_total", "memory_total_bytes", "memory_usable_bytes",
                 "memory_used_bytes", "speculation" (speculative decoding over the nodes
                 that head requests: {"trips", "tokens", "drafted", "accepted",
                 "tokens_per_trip", "acceptance"}, or None when none drafted)},
     "nodes": [{"stage" (hybrid: its group's stage), "rank" (tensor rank, in its group when hybrid, or None),
                "in_plan", "address", "node_id", "name", "chip", "release" (e.g. "0.2.0"),
                "protocol_version" (wire protocol), "state",
                "loading_progress" (0..1), "download" (the stage's files coming from the Hub:
                {"bytes_done", "bytes_total", "fraction", "rate_bytes_per_s", "eta_s", "file"},
                else None), "layer_range" [start, end), "epoch",
                "memory_total_bytes", "memory_usable_bytes", "memory_used_bytes",
                "memory_usable_source" (which rule set the usable figure, in words: the cgroup's
                limit, the host's RAM, the GPU wired limit, --memory-limit),
                "weights_bytes", "tokens_per_s", "tokens_generated_total",
                "requests_in_flight", "hop_latency_median_s", "api_url",
                "batch_mean" (mean decode batch over the node's last 10 s; None: idle or not
                reported), "batch_last", "max_batch", "stage_queued" (steps waiting for the
                stage's worker), "api_queued" (requests waiting for admission at its API),
                "head_tokens_per_s" (tokens/s of the requests it heads),
                "reachable" (None: no API URL known), "error"}],
     "hops": [{"from", "to", "from_name", "to_name", "returns", "kind",
               "bandwidth_bytes_per_s", "rtt_s", "hop_latency_s"}],
     "recent_requests": [{"request_id", "prompt_tokens", "completion_tokens", "ttft_s",
                          "tokens_per_s", ...}],   # newest first
     "prefilling": [{"request_id", "prompt_tokens", "cached_tokens", "processed_tokens",
                     "elapsed_s", "eta_s"}],      # the requests stage 0 prefills now (no token yet)
     "events": [{"ts", "kind", "message"}],       # oldest first
     "models": [...]}  # a node serving several models: each one's ring (.model_rings); else []

Tokens per second: the cluster's own ``tokens_per_s`` when reported; otherwise
the rate of the monotonic counter ``tokens_generated_total`` between successive
snapshots (the dashboard, polling, always has one). A node's counter counts the
tokens of every generation it heads, concurrent ones included, so the cluster's
rate is the sum over nodes and over requests. A single ``ringlet status`` has no
counter rate: it shows 0 when nothing is in flight, else the sum of the nodes'
``batching.head_tokens_per_s`` (each node's own figure over its last 10 s), else
none. In a pipeline every stage processes every token, so a stage with no
``tokens_per_s`` of its own shows the ring's rate.
"""

from __future__ import annotations

import time
from typing import Any

from ringlet.daemon.ops.status.model_rings import models_of
from ringlet.daemon.ops.status.urls import member_api_url
from ringlet.daemon.ops.status.values import (
    as_download,
    as_int,
    as_num,
    as_progress,
    as_range,
    as_str,
    dicts,
    first,
    sum_known,
)

#: States in which a stage counts as healthy.
HEALTHY_STATES = frozenset({"ready", "serving", "alive"})  # "alive": a member not polled, per the membership


def build_snapshot(primary: str | None, infos: dict[str, dict], errors: dict[str, str] | None = None, *,
                   rates: dict[str, float] | None = None, cluster_rate: float | None = None,
                   now: float | None = None, extra_events: list[dict] | None = None,
                   addresses: dict[str, str] | None = None) -> dict:
    """Merge ``/v1/cluster`` answers into one snapshot (schema: module docstring). Pure.

    Args:
        primary: URL of the node whose view of the cluster (plan, epoch, members,
            links, events) is used; ``None`` when no node answered.
        infos: ``{api_url: /v1/cluster JSON}`` of every node that answered.
        errors: ``{api_url: reason}`` of every node polled that did not.
        rates: client-side tokens/s per node gRPC address (from counters).
        cluster_rate: client-side tokens/s of the whole cluster.
        now: snapshot time (unix s).
        extra_events: events observed by the client, merged after the node's own.
        addresses: ``{api_url: gRPC address}`` learnt from earlier answers, so that a
            node that stops answering keeps its place in the ring, marked unreachable.
    """
    errors = dict(errors or {})
    rates = rates or {}
    now = time.time() if now is None else now
    base = infos.get(primary) if primary else None
    snap: dict[str, Any] = {
        "source": primary, "taken_at": now, "reachable": base is not None, "error": None,
        "healthy": False, "cluster": {}, "nodes": [], "hops": [], "recent_requests": [], "prefilling": [],
        "events": [], "models": [],
    }
    if base is None:
        snap["error"] = "; ".join(f"{u}: {e}" for u, e in errors.items()) or "no node answered"
        snap["events"] = list(extra_events or [])
        return snap

    plan = [s for s in dicts(base.get("plan")) if as_str(s.get("address"))]
    # A node is keyed by its address in the plan when its id is there: a node bound to every
    # interface reports 0.0.0.0, and its members may dial it at another of its addresses.
    by_id = {i: s["address"] for s in plan if (i := as_str(s.get("node_id")))}

    # Each answering node, by its gRPC address (its own report about itself).
    own: dict[str, tuple[str, dict]] = {}
    for url, info in infos.items():
        node_id = as_str(info.get("node_id"))
        addr = by_id.get(node_id or "") or as_str(info.get("address")) or node_id
        if addr:
            own[addr] = (url, info)

    members = dicts(base.get("members"))
    member_by_addr: dict[str, dict] = {}
    for m in members:
        key = (by_id.get(as_str(m.get("node_id")) or "") or as_str(m.get("grpc_address")) or as_str(m.get("address"))
               or as_str(m.get("node_id")))
        if key:
            member_by_addr[key] = m

    order: list[str] = [s["address"] for s in plan]
    for addr in list(member_by_addr) + list(own):
        if addr not in order:
            order.append(addr)
    plan_range = {s["address"]: as_range([s.get("start"), s.get("end")]) for s in plan}
    url_errors = {u: e for u, e in errors.items()}

    nodes = []
    for addr in order:
        m = member_by_addr.get(addr, {})
        url, info = own.get(addr, (None, {}))
        mem = info.get("memory") if isinstance(info.get("memory"), dict) else {}
        batching = info.get("batching") if isinstance(info.get("batching"), dict) else {}
        admission = info.get("api") if isinstance(info.get("api"), dict) else {}
        api_url = url or member_api_url(m)
        if api_url is None:
            api_url = next((u for u, a in (addresses or {}).items() if a == addr), None)
        if api_url is not None:
            api_url = api_url.rstrip("/")
        reachable: bool | None
        if url is not None:
            reachable, error = True, None
        elif api_url is not None and api_url in url_errors:
            reachable, error = False, url_errors.pop(api_url)
        else:
            reachable, error = None, None
        state = first(as_str(info.get("state")), as_str(m.get("state")))
        if as_str(m.get("state")) in ("suspect", "left", "gone", "leaving"):
            state = m["state"]  # the cluster's verdict wins over the node's own view
        if reachable is False and state not in ("suspect", "left", "gone"):
            state = "unreachable"
        stage = next((i for i, s in enumerate(plan) if s["address"] == addr), None)
        tps = first(as_num(m.get("tokens_per_s")), as_num(info.get("tokens_per_s")))
        nodes.append({
            "stage": stage,
            "in_plan": stage is not None,
            "address": addr,
            "node_id": first(as_str(m.get("node_id")), as_str(info.get("node_id"))),
            "name": first(as_str(m.get("name")), as_str(info.get("name")), as_str(m.get("node_id")),
                          as_str(info.get("node_id")), addr),
            "chip": first(as_str(m.get("chip")), as_str(info.get("chip"))),
            "release": first(as_str(m.get("release")), as_str(info.get("release"))),
            "protocol_version": first(as_int(m.get("protocol_version")), as_int(info.get("protocol_version"))),
            "state": state,
            "loading_progress": first(as_progress(m.get("loading_progress")),
                                      as_progress(info.get("loading_progress"))),
            "download": as_download(info.get("download")),
            # why it has no network address yet (/v1/cluster's network.waiting; None: it has one)
            "network_waiting": as_str(info["network"].get("waiting")) if isinstance(info.get("network"), dict)
            else None,
            "layer_range": first(as_range(info.get("layer_range")), as_range(m.get("layer_range")),
                                 plan_range.get(addr)),
            "epoch": as_int(info.get("epoch")),
            "memory_total_bytes": first(as_int(m.get("memory_total_bytes")), as_int(mem.get("total_bytes"))),
            "memory_usable_bytes": first(as_int(m.get("memory_usable_bytes")), as_int(mem.get("usable_bytes"))),
            "memory_usable_source": as_str(m.get("memory_usable_source")),
            "memory_used_bytes": first(as_int(m.get("memory_used_bytes")), as_int(mem.get("used_bytes")),
                                       as_int(mem.get("rss_bytes"))),
            "weights_bytes": as_int(mem.get("weights_bytes")),
            # memory taken by other programs (#43): the reason, bytes shed, the offer's cuts
            "memory_pressure": mem.get("pressure") if isinstance(mem.get("pressure"), dict) else None,
            "tokens_per_s": tps,
            "tokens_generated_total": as_int(info.get("tokens_generated_total")),
            "requests_in_flight": as_int(info.get("requests_in_flight")),
            "hop_latency_median_s": as_num(info.get("hop_latency_median_s")),
            "batch_mean": as_num(batching.get("mean_batch_recent")),
            "batch_last": as_int(batching.get("last_batch")),
            "max_batch": as_int(batching.get("max_batch")),
            "stage_queued": as_int(batching.get("queued")),
            "api_queued": as_int(admission.get("queued")),
            "head_tokens_per_s": as_num(batching.get("head_tokens_per_s")),
            **compute_fields(info),
            **prefix_fields(info),
            **migration_fields(info),
            **spec_fields(info),
            "api_url": api_url,
            "reachable": reachable,
            "error": error,
        })

    # Names shared by several nodes (daemons on one machine, identical hostnames) get the
    # start of the node id (or the port), which is also how the event log names nodes.
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["name"]] = counts.get(n["name"], 0) + 1
    for n in nodes:
        if counts[n["name"]] > 1:
            tag = (n["node_id"] or "")[:8] if n["node_id"] and n["node_id"] != n["address"] else (
                n["address"].rsplit(":", 1)[-1])
            if tag and tag not in n["name"]:
                n["name"] = f"{n['name']}·{tag}"

    models = models_of(primary, infos, nodes)  # several models: each one's ring, its stages named as above

    # The ring's rate: the cluster's own figure, else the client-side counter rate, else
    # the stages' own figures (every stage of a pipeline processes every token: the
    # fastest report is the ring's), else 0 when counters exist and nothing is in flight,
    # else the sum of the rates the nodes give for the requests they head (a 10 s window:
    # lags the counters, hence last).
    in_flight = [n["requests_in_flight"] for n in nodes]
    ring_rate = first(as_num(base.get("tokens_per_s")), cluster_rate)
    if ring_rate is None:
        own_rates = [n["tokens_per_s"] for n in nodes if n["in_plan"] and n["tokens_per_s"] is not None]
        ring_rate = max(own_rates) if own_rates else None
    if ring_rate is None and any(n["tokens_generated_total"] is not None for n in nodes) and not sum_known(in_flight):
        ring_rate = 0.0
    if ring_rate is None:
        ring_rate = sum_known([n["head_tokens_per_s"] for n in nodes])
    for n in nodes:
        if n["tokens_per_s"] is None and n["in_plan"] and n["reachable"] is not False and ring_rate is not None:
            n["tokens_per_s"] = ring_rate

    by_addr = {n["address"]: n for n in nodes}
    links = dicts(base.get("links"))
    hops = []
    for i, s in enumerate(plan):
        if len(plan) < 2:
            break
        a = by_addr[s["address"]]
        b = by_addr[plan[(i + 1) % len(plan)]["address"]]
        link = _find_link(links, a, b)
        hops.append({
            "from": a["address"], "to": b["address"], "from_name": a["name"], "to_name": b["name"],
            "returns": i == len(plan) - 1,
            "kind": as_str(link.get("kind")),
            "bandwidth_bytes_per_s": as_num(link.get("bandwidth_bytes_per_s")),
            "rtt_s": as_num(link.get("rtt_s")),
            # measured by the receiving stage: time from send to arrival of a hop
            "hop_latency_s": b["hop_latency_median_s"],
        })

    tp = base.get("tp") if isinstance(base.get("tp"), dict) else {}
    ranks = [str(r) for r in tp.get("ranks") or [] if isinstance(r, str)]
    for n in nodes:
        n["rank"] = ranks.index(n["node_id"]) if n["node_id"] in ranks else None
    leader_states: dict[str, str | None] = {}
    for info in infos.values():  # each group's leader (its rank 0) reports its group
        g = info.get("tp", {}).get("group") if isinstance(info.get("tp"), dict) else None
        if isinstance(g, dict) and as_int(g.get("plan_epoch")) == as_int(base.get("epoch")):
            leader_states[as_str(info.get("node_id")) or ""] = as_str(g.get("state"))
    groups = _hybrid_groups(tp, leader_states)
    if groups:
        for n in nodes:  # a group's members share its stage and layer range; rank = within the group
            for i, g in enumerate(groups):
                if n["node_id"] in g["ranks"]:
                    n.update(stage=i, in_plan=True, rank=g["ranks"].index(n["node_id"]),
                             layer_range=g["layers"] or n["layer_range"])
        nodes.sort(key=lambda n: (n["stage"] is None, n["stage"] or 0, n["rank"] or 0))
    states = [g["state"] for g in groups] if groups else list(leader_states.values())
    group_state = next((x for x in states if x != "ready"), "ready") if states else None

    in_plan = [n for n in nodes if n["in_plan"]]
    ready = [n for n in in_plan if n["state"] in HEALTHY_STATES]
    counters = [n["tokens_generated_total"] for n in nodes]
    cluster = {
        "model": as_str(base.get("model")),
        "num_layers": as_int(base.get("num_layers")),
        "epoch": as_int(base.get("epoch")),
        "policy": base.get("policy"),
        "mode": base.get("mode"),
        "backend": as_str(tp.get("backend")),
        "ranks": ranks,
        "mode_reason": as_str(tp.get("reason")),
        "mode_refused": as_str(tp.get("refused")),
        "tensor_group": group_state,
        "groups": groups,
        "negotiation": base.get("negotiation"),
        "routes": dicts(base.get("routes")),
        "incompatible": dicts(base.get("incompatible")),
        "nodes": len(in_plan),
        "nodes_ready": len(ready),
        "requests_in_flight": first(sum_known(in_flight), as_int(base.get("requests_in_flight"))),
        "tokens_per_s": ring_rate,
        "tokens_generated_total": sum_known(counters),
        "memory_total_bytes": sum_known([n["memory_total_bytes"] for n in in_plan]),
        "memory_usable_bytes": sum_known([n["memory_usable_bytes"] for n in in_plan]),
        "memory_used_bytes": sum_known([n["memory_used_bytes"] for n in in_plan]),
        "prefix_bytes": sum_known([n["prefix_bytes"] for n in in_plan]),
        "prefix_hits": sum_known([n["prefix_hits"] for n in in_plan]),
        "prefix_misses": sum_known([n["prefix_misses"] for n in in_plan]),
        "prefix_disk_bytes": sum_known([n["prefix_disk_bytes"] for n in in_plan]),
        "kv_migration": migration_summary(nodes),
        "speculation": spec_summary(nodes),
    }
    if cluster["num_layers"] is None and plan:
        ends = [as_int(s.get("end")) for s in plan]
        cluster["num_layers"] = max((e for e in ends if e is not None), default=None)

    # Recent requests of every node (today stage 0 holds them), newest first, once each.
    recent: list[dict] = []
    seen: set[str] = set()
    for url in [primary] + [u for u in infos if u != primary]:
        for r in reversed(dicts(infos[url].get("recent_requests"))):
            rid = str(r.get("request_id", ""))
            if rid and rid in seen:
                continue
            seen.add(rid)
            recent.append(r)
    if any(as_num(r.get("finished_at")) is not None for r in recent):
        recent.sort(key=lambda r: as_num(r.get("finished_at")) or 0.0, reverse=True)

    prefilling = [p for url in [primary] + [u for u in infos if u != primary]
                  for p in dicts(infos[url].get("prefilling"))]
    events = [e for e in dicts(base.get("events"))] + list(extra_events or [])
    snap.update(
        # a tensor plan serves only through its group: a group not ready (starting, failed) is not healthy;
        # nor is a plan that names an address one of its members cannot reach
        healthy=bool(in_plan) and len(ready) == len(in_plan) and (
            not ranks or group_state is None or group_state == "ready")
        and not any(r.get("in_plan") for r in cluster["routes"])
        and all(m["state"] == "serving" for m in models),  # several models: each one serving
        cluster=cluster, nodes=nodes, hops=hops, recent_requests=recent, prefilling=prefilling, events=events,
        models=models,
    )
    unreached = {u: e for u, e in url_errors.items() if u != primary}
    if unreached:
        snap["error"] = "; ".join(f"{u}: {e}" for u, e in unreached.items())
    return snap


def _hybrid_groups(tp: dict, leader_states: dict[str, str | None]) -> list[dict]:
    """The groups of a hybrid decision, in stage order: ranks, layer range, backend and
    the state its leader reports (``None`` when not heard from); ``[]`` otherwise."""
    if tp.get("mode") != "hybrid":
        return []
    raw = tp.get("groups") if isinstance(tp.get("groups"), list) else []
    ranges = tp.get("layer_ranges") if isinstance(tp.get("layer_ranges"), list) else []
    backends = tp.get("group_backends") if isinstance(tp.get("group_backends"), list) else []
    out = []
    for i, g in enumerate(raw):
        members = [str(r) for r in g if isinstance(r, str)] if isinstance(g, list) else []
        if not members:
            continue
        out.append({"ranks": members, "layers": as_range(ranges[i]) if i < len(ranges) else None,
                    "backend": as_str(backends[i]) if i < len(backends) else None,
                    "state": leader_states.get(members[0])})
    return out


def _find_link(links: list[dict], a: dict, b: dict) -> dict:
    """The link between nodes ``a`` and ``b`` (either direction; ends named by node id or address)."""
    ka = {a["address"], a["node_id"], a["name"]} - {None}
    kb = {b["address"], b["node_id"], b["name"]} - {None}
    for link in links:
        x, y = link.get("a"), link.get("b")
        if (x in ka and y in kb) or (x in kb and y in ka):
            return link
    return {}


def compute_fields(info: dict) -> dict:
    """``compute`` (the loaded precision and the BLAS, e.g. ``float32 · openblas``) and
    ``compute_fix`` (what to do when either is the slow path, else ``None``) of one node's
    ``/v1/cluster``; ``None`` for what it does not report."""
    blas = info.get("blas") if isinstance(info.get("blas"), dict) else {}
    dtype = info.get("dtype") if isinstance(info.get("dtype"), dict) else {}
    kind = as_str(blas.get("kind"))
    lib = as_str(blas.get("library"))
    stem = (lib or "optimized").rsplit("/", 1)[-1].split(".so")[0].removeprefix("lib")
    blas_name = {"optimized": "openblas" if "openblas" in stem else stem,
                 "bundled": "reference BLAS", "platform": "platform BLAS"}.get(kind or "", None)
    parts = [p for p in (as_str(dtype.get("loaded")), blas_name) if p]
    fixes = []
    if kind == "bundled" and blas.get("fix"):
        fixes.append(str(blas["fix"]))
    if kind == "optimized" and blas.get("gemv_fix"):
        fixes.append(str(blas["gemv_fix"]))
    if dtype.get("slow_path"):
        fixes.append(str(dtype.get("reason")))
    return {"compute": " · ".join(parts) or None, "compute_fix": "; ".join(fixes) or None}


def prefix_fields(info: dict) -> dict:
    """One node's prefix store figures (``/v1/cluster``'s ``prefix_cache``): bytes and
    entries held, its budget, hits, misses and evictions, and the disk tier's bytes and
    entries; ``None`` for what it does not report."""
    pc = info.get("prefix_cache") if isinstance(info.get("prefix_cache"), dict) else {}
    disk = pc.get("disk") if isinstance(pc.get("disk"), dict) else {}
    return {**{f"prefix_{k}": as_int(pc.get(k)) for k in ("bytes", "budget_bytes", "entries", "hits", "misses",
                                                           "evictions")},
            "prefix_disk_bytes": as_int(disk.get("bytes")), "prefix_disk_entries": as_int(disk.get("entries"))}


#: The counters of a re-plan's ``kv_migration`` figures (``ringlet.daemon.node.migration.COUNTERS``;
#: named here so that ``status`` does not import the node, and MLX with it).
KV_COUNTERS = ("kv_bytes_received", "kv_bytes_sent", "resumed", "reprefilled_tokens", "full_reprefills",
               "rebuilt_tokens", "precopied_bytes")


def migration_fields(info: dict) -> dict:
    """One node's KV migration figures at its last re-plan (``/v1/cluster``'s
    ``kv_migration.last``): epoch, bytes received and sent, requests resumed, tokens
    prefilled again, full re-prefills and tokens rebuilt from boundary activations."""
    last = info.get("kv_migration", {}).get("last") if isinstance(info.get("kv_migration"), dict) else None
    last = last if isinstance(last, dict) else {}
    return {"kv_epoch": as_int(last.get("epoch")), **{f"kv_{k}": as_int(last.get(k)) for k in KV_COUNTERS}}


def migration_summary(nodes: list[dict]) -> dict | None:
    """The last re-plan's KV migration over every node that reported it (``None``: none did)."""
    epochs = [n["kv_epoch"] for n in nodes if n.get("kv_epoch") is not None]
    if not epochs:
        return None
    epoch = max(epochs)
    at = [n for n in nodes if n.get("kv_epoch") == epoch]
    return {"epoch": epoch, **{k: sum(n.get(f"kv_{k}") or 0 for n in at) for k in KV_COUNTERS}}


SPEC_COUNTERS = ("trips", "tokens", "drafted", "accepted")


def spec_fields(info: dict) -> dict:
    """One node's speculative decoding counters (``/v1/cluster``'s ``speculation``:
    verifying trips, the tokens they gave, drafted and accepted tokens)."""
    spec = info.get("speculation") if isinstance(info.get("speculation"), dict) else {}
    return {f"spec_{k}": as_int(spec.get(k)) for k in SPEC_COUNTERS}


def spec_summary(nodes: list[dict]) -> dict | None:
    """Speculative decoding over every node: the counters summed, tokens per trip and the
    acceptance rate (``None``: no node made a verifying trip)."""
    sums = {k: sum(n.get(f"spec_{k}") or 0 for n in nodes) for k in SPEC_COUNTERS}
    if not sums["trips"]:
        return None
    return {**sums, "tokens_per_trip": sums["tokens"] / sums["trips"],
            "acceptance": sums["accepted"] / sums["drafted"] if sums["drafted"] else None}
