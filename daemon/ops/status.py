"""``ringlet status``: one snapshot of the cluster, as seen through nodes' ``GET /v1/cluster``.

The snapshot is the data the dashboard draws (:mod:`ringlet.daemon.ops.dashboard`) and
what ``ringlet status --json`` prints for scripts. It is built in two steps:

1. **fetch** (:class:`Collector`): ``GET /v1/cluster`` from every API URL known --
   the ``--api`` URLs given (the first one that answers is the *primary*) and
   every ``members[].api_url`` a node reported -- concurrently, each with a short
   timeout. A node that does not answer is marked unreachable; nothing raises.
2. **normalise** (:func:`build_snapshot`, pure): merge the answers into one
   JSON-safe dict, in ring (plan) order. Every field of ``/v1/cluster`` is
   optional: what a node does not report is ``None`` and drawn as "—".

Snapshot schema (all sizes in bytes, times in seconds, rates per second)::

    {"source": primary URL, "taken_at": unix s, "reachable": bool, "error": str|None,
     "healthy": bool,                       # reachable, every plan stage ready/serving, tensor group ready
     "cluster": {"model", "num_layers", "epoch", "policy", "mode", "backend",
                 "ranks" [node ids, rank order; empty unless tensor or hybrid], "mode_reason",
                 "mode_refused" (why --mode tensor/hybrid could not run, or None),
                 "tensor_group" (the leader's group state, or None; hybrid: "ready" when
                 every group is, else the first other state), "groups" (hybrid: [{"ranks",
                 "layers" [start, end), "backend", "state"}] in stage order, else []),
                 "negotiation",
                 "nodes", "nodes_ready", "requests_in_flight", "tokens_per_s",
                 "tokens_generated_total", "memory_total_bytes", "memory_usable_bytes",
                 "memory_used_bytes"},
     "nodes": [{"stage" (hybrid: its group's stage), "rank" (tensor rank, in its group when hybrid, or None),
                "in_plan", "address", "node_id", "name", "chip", "state",
                "loading_progress" (0..1), "layer_range" [start, end), "epoch",
                "memory_total_bytes", "memory_usable_bytes", "memory_used_bytes",
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
     "events": [{"ts", "kind", "message"}]}       # oldest first

Tokens per second: the cluster's own ``tokens_per_s`` when reported; otherwise
the rate of the monotonic counter ``tokens_generated_total`` between successive
snapshots (the dashboard, polling, always has one). A node's counter counts the
tokens of every generation it heads, concurrent ones included, so the cluster's
rate is the sum over nodes and over requests. A single ``ringlet status`` has no
counter rate: it shows 0 when nothing is in flight, else the sum of the nodes'
``batching.head_tokens_per_s`` (each node's own figure over its last 10 s), else
none. In a pipeline every stage processes every token, so a stage with no
``tokens_per_s`` of its own shows the ring's rate.

Exit status of ``ringlet status``: 0 every stage of the plan is ready or serving,
1 no node answered, 2 bad input, 3 reachable but some stage is not ready
(loading, suspect, unreachable, ...).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httpx

from ringlet.daemon.errors import RingletError

DEFAULT_API = "http://127.0.0.1:8000"
#: States in which a stage counts as healthy.
HEALTHY_STATES = frozenset({"ready", "serving", "alive"})  # "alive": a member not polled, per the membership
#: Seconds of counter history the client-side rate is computed over.
RATE_WINDOW_S = 2.0
EXIT_OK, EXIT_UNREACHABLE, EXIT_BAD_INPUT, EXIT_DEGRADED = 0, 1, 2, 3


# --------------------------------------------------------------------------- input


def normalize_api_url(url: str) -> str:
    """``host:port`` / ``http://host:port/`` -> ``http://host:port``.

    Raises:
        RingletError: not an http(s) URL with a host.
    """
    text = (url or "").strip()
    if not text:
        raise RingletError("--api: empty URL; give a node's API base URL, e.g. http://127.0.0.1:8000")
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise RingletError(f"--api {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RingletError(f"--api {url!r}: not an http(s) URL with a host (e.g. http://127.0.0.1:8000)")
    if port == 0:
        raise RingletError(f"--api {url!r}: port 0")
    return text.rstrip("/")


def default_api_url() -> str:
    """This machine's daemon: the API address of the installed service's configuration
    (``ringlet service install``), else :data:`DEFAULT_API`."""
    try:
        from ringlet.daemon.ops.service import _api_host, load_config

        cfg = load_config()
    except Exception:  # an unreadable configuration is service status's business, not ours
        return DEFAULT_API
    if cfg is None or (cfg.api_port is None and cfg.api_host is None):
        return DEFAULT_API
    return f"http://{_api_host(cfg)}:{cfg.api_port or 8000}"


# --------------------------------------------------------------------------- helpers


def _num(value: Any) -> float | None:
    """A finite number or ``None`` (bools and strings are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    return value


def _int(value: Any) -> int | None:
    v = _num(value)
    return int(v) if v is not None else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _range(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        a, b = _int(value[0]), _int(value[1])
        if a is not None and b is not None:
            return [a, b]
    return None


def _progress(value: Any) -> float | None:
    """Loading progress as a fraction 0..1 (a value above 1 is read as a percentage)."""
    v = _num(value)
    if v is None:
        return None
    if v > 1.0:
        v = v / 100.0
    return max(0.0, min(1.0, float(v)))


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _dicts(value: Any) -> list[dict]:
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


# --------------------------------------------------------------------------- normalise


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
        "healthy": False, "cluster": {}, "nodes": [], "hops": [], "recent_requests": [], "events": [],
    }
    if base is None:
        snap["error"] = "; ".join(f"{u}: {e}" for u, e in errors.items()) or "no node answered"
        snap["events"] = list(extra_events or [])
        return snap

    # Each answering node, by its gRPC address (its own report about itself).
    own: dict[str, tuple[str, dict]] = {}
    for url, info in infos.items():
        addr = _str(info.get("address")) or _str(info.get("node_id"))
        if addr:
            own[addr] = (url, info)

    plan = [s for s in _dicts(base.get("plan")) if _str(s.get("address"))]
    members = _dicts(base.get("members"))
    member_by_addr: dict[str, dict] = {}
    for m in members:
        key = _str(m.get("grpc_address")) or _str(m.get("address")) or _str(m.get("node_id"))
        if key:
            member_by_addr[key] = m

    order: list[str] = [s["address"] for s in plan]
    for addr in list(member_by_addr) + list(own):
        if addr not in order:
            order.append(addr)
    plan_range = {s["address"]: _range([s.get("start"), s.get("end")]) for s in plan}
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
        state = _first(_str(info.get("state")), _str(m.get("state")))
        if _str(m.get("state")) in ("suspect", "left", "gone", "leaving"):
            state = m["state"]  # the cluster's verdict wins over the node's own view
        if reachable is False and state not in ("suspect", "left", "gone"):
            state = "unreachable"
        stage = next((i for i, s in enumerate(plan) if s["address"] == addr), None)
        tps = _first(_num(m.get("tokens_per_s")), _num(info.get("tokens_per_s")))
        nodes.append({
            "stage": stage,
            "in_plan": stage is not None,
            "address": addr,
            "node_id": _first(_str(m.get("node_id")), _str(info.get("node_id"))),
            "name": _first(_str(m.get("name")), _str(info.get("name")), _str(m.get("node_id")),
                           _str(info.get("node_id")), addr),
            "chip": _first(_str(m.get("chip")), _str(info.get("chip"))),
            "state": state,
            "loading_progress": _first(_progress(m.get("loading_progress")), _progress(info.get("loading_progress"))),
            "layer_range": _first(_range(info.get("layer_range")), _range(m.get("layer_range")),
                                  plan_range.get(addr)),
            "epoch": _int(info.get("epoch")),
            "memory_total_bytes": _first(_int(m.get("memory_total_bytes")), _int(mem.get("total_bytes"))),
            "memory_usable_bytes": _first(_int(m.get("memory_usable_bytes")), _int(mem.get("usable_bytes"))),
            "memory_used_bytes": _first(_int(m.get("memory_used_bytes")), _int(mem.get("used_bytes")),
                                        _int(mem.get("rss_bytes"))),
            "weights_bytes": _int(mem.get("stage_param_bytes")),
            "tokens_per_s": tps,
            "tokens_generated_total": _int(info.get("tokens_generated_total")),
            "requests_in_flight": _int(info.get("requests_in_flight")),
            "hop_latency_median_s": _num(info.get("hop_latency_median_s")),
            "batch_mean": _num(batching.get("mean_batch_recent")),
            "batch_last": _int(batching.get("last_batch")),
            "max_batch": _int(batching.get("max_batch")),
            "stage_queued": _int(batching.get("queued")),
            "api_queued": _int(admission.get("queued")),
            "head_tokens_per_s": _num(batching.get("head_tokens_per_s")),
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

    # The ring's rate: the cluster's own figure, else the client-side counter rate, else
    # the stages' own figures (every stage of a pipeline processes every token: the
    # fastest report is the ring's), else 0 when counters exist and nothing is in flight,
    # else the sum of the rates the nodes give for the requests they head (a 10 s window:
    # lags the counters, hence last).
    in_flight = [n["requests_in_flight"] for n in nodes]
    ring_rate = _first(_num(base.get("tokens_per_s")), cluster_rate)
    if ring_rate is None:
        own_rates = [n["tokens_per_s"] for n in nodes if n["in_plan"] and n["tokens_per_s"] is not None]
        ring_rate = max(own_rates) if own_rates else None
    if ring_rate is None and any(n["tokens_generated_total"] is not None for n in nodes) and not _sum(in_flight):
        ring_rate = 0.0
    if ring_rate is None:
        ring_rate = _sum([n["head_tokens_per_s"] for n in nodes])
    for n in nodes:
        if n["tokens_per_s"] is None and n["in_plan"] and n["reachable"] is not False and ring_rate is not None:
            n["tokens_per_s"] = ring_rate

    by_addr = {n["address"]: n for n in nodes}
    links = _dicts(base.get("links"))
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
            "kind": _str(link.get("kind")),
            "bandwidth_bytes_per_s": _num(link.get("bandwidth_bytes_per_s")),
            "rtt_s": _num(link.get("rtt_s")),
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
        if isinstance(g, dict) and _int(g.get("plan_epoch")) == _int(base.get("epoch")):
            leader_states[_str(info.get("node_id")) or ""] = _str(g.get("state"))
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
        "model": _str(base.get("model")),
        "num_layers": _int(base.get("num_layers")),
        "epoch": _int(base.get("epoch")),
        "policy": base.get("policy"),
        "mode": base.get("mode"),
        "backend": _str(tp.get("backend")),
        "ranks": ranks,
        "mode_reason": _str(tp.get("reason")),
        "mode_refused": _str(tp.get("refused")),
        "tensor_group": group_state,
        "groups": groups,
        "negotiation": base.get("negotiation"),
        "nodes": len(in_plan),
        "nodes_ready": len(ready),
        "requests_in_flight": _first(_sum(in_flight), _int(base.get("requests_in_flight"))),
        "tokens_per_s": ring_rate,
        "tokens_generated_total": _sum(counters),
        "memory_total_bytes": _sum([n["memory_total_bytes"] for n in in_plan]),
        "memory_usable_bytes": _sum([n["memory_usable_bytes"] for n in in_plan]),
        "memory_used_bytes": _sum([n["memory_used_bytes"] for n in in_plan]),
    }
    if cluster["num_layers"] is None and plan:
        ends = [_int(s.get("end")) for s in plan]
        cluster["num_layers"] = max((e for e in ends if e is not None), default=None)

    # Recent requests of every node (today stage 0 holds them), newest first, once each.
    recent: list[dict] = []
    seen: set[str] = set()
    for url in [primary] + [u for u in infos if u != primary]:
        for r in reversed(_dicts(infos[url].get("recent_requests"))):
            rid = str(r.get("request_id", ""))
            if rid and rid in seen:
                continue
            seen.add(rid)
            recent.append(r)
    if any(_num(r.get("finished_at")) is not None for r in recent):
        recent.sort(key=lambda r: _num(r.get("finished_at")) or 0.0, reverse=True)

    events = [e for e in _dicts(base.get("events"))] + list(extra_events or [])
    snap.update(
        # a tensor plan serves only through its group: a group not ready (starting, failed) is not healthy
        healthy=bool(in_plan) and len(ready) == len(in_plan) and (
            not ranks or group_state is None or group_state == "ready"),
        cluster=cluster, nodes=nodes, hops=hops, recent_requests=recent, events=events,
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
        out.append({"ranks": members, "layers": _range(ranges[i]) if i < len(ranges) else None,
                    "backend": _str(backends[i]) if i < len(backends) else None,
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


# --------------------------------------------------------------------------- fetch

_WILDCARDS = ("0.0.0.0", "::", "[::]", "")  # noqa: S104 - addresses compared, never bound


def member_api_url(member: dict) -> str | None:
    """A member's API URL, reachable from here: a wildcard host (a daemon bound to
    ``0.0.0.0`` reports ``http://0.0.0.0:8000``) is replaced by the host of its gRPC
    address; ``None`` when neither names a host."""
    url = _str(member.get("api_url"))
    if not url:
        return None
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return None
    if host not in _WILDCARDS and host != "::":
        return url
    grpc = _str(member.get("grpc_address")) or ""
    ghost = grpc.rsplit(":", 1)[0].strip("[]") if ":" in grpc else ""
    if ghost in _WILDCARDS or ghost == "::" or port is None:
        return None
    return f"{parts.scheme}://{'[' + ghost + ']' if ':' in ghost else ghost}:{port}"



def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        return f"cannot connect ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, (ValueError, json.JSONDecodeError)):
        return "answer is not JSON"
    return str(exc) or type(exc).__name__


class Collector:
    """Polls ``/v1/cluster`` of the given nodes (and of every member they report) and
    builds snapshots; keeps the counter history for client-side tokens/s.

    Args:
        api_urls: API base URLs; the first one that answers is the primary.
        timeout_s: per-request timeout.
    """

    def __init__(self, api_urls: list[str], timeout_s: float = 1.0, api_key: str | None = None):
        if not api_urls:
            api_urls = [default_api_url()]
        self.api_urls = [normalize_api_url(u) for u in api_urls]
        self.timeout_s = timeout_s
        self.discovered: list[str] = []
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        #: api_url -> gRPC address, from every answer so far
        self.addresses: dict[str, str] = {}
        self._client: httpx.AsyncClient | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _get(self, client: httpx.AsyncClient, url: str) -> dict:
        resp = await client.get(f"{url}/v1/cluster")
        resp.raise_for_status()
        data = resp.json()
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data

    async def fetch(self) -> tuple[str | None, dict[str, dict], dict[str, str]]:
        """One round of requests: ``(primary, infos, errors)``."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, headers=self._headers)
        urls = list(dict.fromkeys(self.api_urls + self.discovered))
        results = await asyncio.gather(*(self._get(self._client, u) for u in urls), return_exceptions=True)
        infos: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for url, res in zip(urls, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                errors[url] = _reason(res)
            else:
                infos[url] = res
        primary = next((u for u in urls if u in infos), None)
        # members' API URLs: polled from the next round on (and now, when new)
        listed: list[str] = []  # members' API URLs, as the nodes that answered list them now
        for info in infos.values():
            for m in _dicts(info.get("members")):
                url = member_api_url(m)
                if url:
                    try:
                        url = normalize_api_url(url)
                    except RingletError:
                        continue
                    if url not in listed:
                        listed.append(url)
        if infos:  # a member that left is no longer polled (the --api URLs always are)
            self.discovered = [u for u in self.discovered if u in listed]
        new = [u for u in listed if u not in urls]
        if new:
            self.discovered.extend(new)
            more = await asyncio.gather(*(self._get(self._client, u) for u in new), return_exceptions=True)
            for url, res in zip(new, more, strict=True):
                if isinstance(res, Exception):
                    errors[url] = _reason(res)
                elif isinstance(res, dict):
                    infos[url] = res
            if primary is None:
                primary = next((u for u in new if u in infos), None)
        return primary, infos, errors

    def rates(self, infos: dict[str, dict], now: float) -> tuple[dict[str, float], float | None]:
        """Client-side tokens/s per node (by gRPC address) from ``tokens_generated_total``."""
        rates: dict[str, float] = {}
        for info in infos.values():
            addr = _str(info.get("address")) or _str(info.get("node_id"))
            count = _int(info.get("tokens_generated_total"))
            if not addr or count is None:
                continue
            samples = self._samples.setdefault(addr, deque())
            if samples and count < samples[-1][1]:
                samples.clear()  # the node restarted: its counter started over
            samples.append((now, count))
            while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
                samples.popleft()
            t0, c0 = samples[0]
            if now - t0 > 0.05:
                rates[addr] = (count - c0) / (now - t0)
        total = sum(rates.values()) if rates else None
        return rates, total

    async def snapshot(self, extra_events: list[dict] | None = None) -> dict:
        """Poll once and build a snapshot; never raises for an unreachable node."""
        primary, infos, errors = await self.fetch()
        now = time.time()
        rates, total = self.rates(infos, now)
        for url, info in infos.items():
            addr = _str(info.get("address")) or _str(info.get("node_id"))
            if addr:
                self.addresses[url] = addr
        return build_snapshot(primary, infos, errors, rates=rates, cluster_rate=total, now=now,
                              extra_events=extra_events, addresses=self.addresses)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def take_snapshot(api_urls: list[str], timeout_s: float = 2.0, api_key: str | None = None) -> dict:
    """One snapshot, synchronously (for ``ringlet status`` and scripts); ``api_key`` is
    sent as a bearer key (nodes run with ``--api-key-file``)."""

    async def once() -> dict:
        c = Collector(api_urls, timeout_s=timeout_s, api_key=api_key)
        try:
            return await c.snapshot()
        finally:
            await c.aclose()

    return asyncio.run(once())


def exit_status(snap: dict) -> int:
    """0 healthy, 1 no node answered, 3 reachable but some stage not ready."""
    if not snap["reachable"]:
        return EXIT_UNREACHABLE
    return EXIT_OK if snap["healthy"] else EXIT_DEGRADED


# --------------------------------------------------------------------------- text


def format_status(snap: dict) -> str:
    """The snapshot as plain text: a summary line and one aligned row per node, never
    truncated (for people and ``grep``)."""
    from ringlet.daemon.ops.format import fmt_batch, fmt_bytes, fmt_range, fmt_rate, policy_text

    if not snap["reachable"]:
        return f"unreachable: {snap['error']}\n"
    c = snap["cluster"]

    def v(x) -> str:
        return "—" if x is None else str(x)

    lines = [" · ".join([
        f"model {v(c['model'])}", f"layers {v(c['num_layers'])}", f"epoch {v(c['epoch'])}",
        f"policy {policy_text(c['policy'])}", f"nodes {c['nodes_ready']}/{c['nodes']} ready",
        f"in flight {v(c['requests_in_flight'])}", f"tokens/s {fmt_rate(c['tokens_per_s'])}",
    ])]
    if c.get("mode") is not None:
        mode = [f"mode {c['mode']}"]
        if c.get("backend") and c["backend"] != "none":
            mode.append(f"backend {c['backend']}")
        names = {n["node_id"]: n["name"] for n in snap["nodes"]}
        if c.get("groups"):
            mode.append("groups " + " | ".join(
                f"{fmt_range(g['layers']).replace(' ', '')} " + ", ".join(f"{i} {names.get(r, r)}"
                                                                         for i, r in enumerate(g["ranks"]))
                for g in c["groups"]))
        elif c.get("ranks"):
            mode.append("ranks " + ", ".join(f"{i} {names.get(r, r)}" for i, r in enumerate(c["ranks"])))
        if c.get("tensor_group"):
            mode.append(f"group {c['tensor_group']}")
        lines.append(" · ".join(mode))
        if c.get("mode_reason"):
            lines.append(f"why: {c['mode_reason']}")
    rows = [("stage", "node", "state", "layers", "memory", "tok/s", "batch", "grpc", "api")]
    for n in snap["nodes"]:
        mem = fmt_bytes(n["memory_used_bytes"]).replace(" ", "")
        if n["memory_total_bytes"]:
            mem += "/" + fmt_bytes(n["memory_total_bytes"]).replace(" ", "")
        rows.append((v(n["stage"]), n["name"], v(n["state"]), fmt_range(n["layer_range"]).replace(" ", ""), mem,
                     fmt_rate(n["tokens_per_s"]), fmt_batch(n.get("batch_mean"), n.get("max_batch")), n["address"],
                     v(n["api_url"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if snap["error"]:
        lines.append(f"not reached: {snap['error']}")
    return "\n".join(lines) + "\n"


def run_status(args) -> int:
    """``ringlet status``."""
    from ringlet.daemon.wire.auth import client_api_key

    snap = take_snapshot(args.api or [default_api_url()], timeout_s=args.timeout,
                         api_key=client_api_key(getattr(args, "api_key_file", None)))
    if args.json:
        sys.stdout.write(json.dumps(snap, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(format_status(snap))
    return exit_status(snap)
