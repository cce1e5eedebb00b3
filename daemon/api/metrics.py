"""``GET /metrics``: the node in Prometheus' text format (``prometheus_client``).

Two kinds of figures, in one registry per app:

* counted as requests are answered: ``ringlet_requests_total{surface, status}`` (every
  API request but ``/metrics`` itself and ``/healthz``), ``ringlet_tokens_total{kind}``
  (``prompt``, ``cached`` — prompt tokens the prefix cache served —, ``completion``), and
  the histograms ``ringlet_time_to_first_token_seconds`` (from the request's start to its
  first output) and ``ringlet_inter_token_latency_seconds`` (between two outputs of a
  stream, each a token or a few);
* read from the node at each scrape (:class:`NodeCollector`): members, plan epoch and
  plans committed, memory usable / used / held (weights, KV, prefix store), requests in
  flight, queues (API admission, stage steps), prefix-cache hits and misses, step time of
  this node's stage, median hop time, tokens/s, speculation's drafted and accepted tokens.

Names follow Prometheus' conventions (base units, ``_total`` counters). With API keys set,
``/metrics`` wants one like ``/v1/*`` (Prometheus: ``authorization: {credentials: …}``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "CountRequests", "Metrics", "NodeCollector", "RequestClock", "surface_of"]

#: Seconds: TTFT spans a short prompt to a long prefill across a ring.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Seconds: a decode step of one stage on a laptop to a ring of four over Ethernet.
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SURFACES = (("/v1/chat/completions", "openai"), ("/v1/completions", "openai"), ("/v1/responses", "responses"),
             ("/v1/messages", "anthropic"), ("/api/", "ollama"), ("/v1/", "cluster"))


def surface_of(path: str) -> str | None:
    """The API surface a request path belongs to (``None``: not counted: ``/metrics``,
    ``/healthz``)."""
    return next((name for prefix, name in _SURFACES if path.startswith(prefix)), None if path in (
        "/metrics", "/healthz") else "other")


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class NodeCollector:
    """The node's figures, read at each scrape (``prometheus_client`` custom collector).

    Args:
        node: the :class:`~ringlet.daemon.node.Node` (``info()``, its engine).
        admission: ``() -> (running, waiting)`` of the API's admission queue.
    """

    def __init__(self, node, admission: Callable[[], tuple[int, int]]):
        self.node, self.admission = node, admission

    def collect(self) -> Iterator[Any]:
        """The metric families (Prometheus calls it at each scrape)."""
        info = self.node.info()
        mem = info.get("memory") or {}
        gauge = GaugeMetricFamily
        yield gauge("ringlet_members", "Members of this node's cluster it sees (itself included)",
                    value=len(info.get("members") or []) or 1)
        yield gauge("ringlet_plan_epoch", "Epoch of the committed plan", value=info.get("epoch") or 0)
        yield CounterMetricFamily("ringlet_plans_committed", "Plans this node committed since it started",
                                  value=getattr(self.node, "commits", 0))
        usable = (info.get("members") and next((m.get("memory_usable_bytes") for m in info["members"]
                                                if m.get("node_id") == info.get("node_id")), None))
        if (u := _num(usable)) is not None:
            yield gauge("ringlet_memory_usable_bytes", "Memory this node offers the planner", value=u)
        used = gauge("ringlet_memory_bytes", "Memory this node holds, by what", labels=["kind"])
        for kind, key in (("rss", "rss_bytes"), ("weights", "weights_bytes"), ("kv_cache", "kv_cache_bytes"),
                          ("prefix_cache", "prefix_cache_bytes"), ("mlx_active", "mlx_active_bytes")):
            if (v := _num(mem.get(key))) is not None:
                used.add_metric([kind], v)
        yield used
        planned = (mem.get("planned") or {}).get("total_bytes")
        if (p := _num(planned)) is not None:
            yield gauge("ringlet_memory_planned_bytes", "What the plan gives this node to hold, all in", value=p)
        yield gauge("ringlet_requests_in_flight", "Requests this node heads now", value=info.get("requests_in_flight")
                    or 0)
        running, waiting = self.admission()
        queue = gauge("ringlet_queue_length", "Work waiting, by where", labels=["where"])
        queue.add_metric(["api"], waiting)
        engine = getattr(self.node, "engine", None)
        queue.add_metric(["stage"], engine.queued if engine is not None else 0)
        yield queue
        prefix = info.get("prefix_cache") or {}
        lookups = CounterMetricFamily("ringlet_prefix_cache_lookups", "Prefix-cache lookups of this node's stage",
                                      labels=["result"])
        lookups.add_metric(["hit"], prefix.get("hits") or 0)
        lookups.add_metric(["miss"], prefix.get("misses") or 0)
        yield lookups
        if engine is not None:
            count, seconds = engine.step_seconds
            yield SummaryMetricFamily("ringlet_stage_step_seconds", "Rounds of this node's stage (one forward of "
                                      "a batch or a prefill chunk) and their time", count_value=count,
                                      sum_value=seconds)
        if (hop := _num(info.get("hop_latency_median_s"))) is not None:
            yield gauge("ringlet_hop_latency_median_seconds", "Median time of this node's recent hops to the next "
                        "stage", value=hop)
        batching = info.get("batching") or {}
        if (tps := _num(batching.get("head_tokens_per_s"))) is not None:
            yield gauge("ringlet_tokens_per_second", "Tokens/s of the requests this node heads (last 10 s)",
                        value=tps)
        spec = info.get("speculation") or {}
        drafts = CounterMetricFamily("ringlet_draft_tokens", "Drafted tokens this node verified, by outcome",
                                     labels=["outcome"])
        accepted, drafted = spec.get("accepted") or 0, spec.get("drafted") or 0
        drafts.add_metric(["accepted"], accepted)
        drafts.add_metric(["rejected"], max(0, drafted - accepted))
        yield drafts


class Metrics:
    """One app's metrics (module docstring).

    Args:
        node: the serving node.
        admission: ``() -> (running, waiting)`` of the API's admission queue.
    """

    def __init__(self, node, admission: Callable[[], tuple[int, int]]):
        self.registry = CollectorRegistry()
        self.requests = Counter("ringlet_requests", "API requests answered, by surface and HTTP status",
                                ["surface", "status"], registry=self.registry)
        self.tokens = Counter("ringlet_tokens", "Tokens of the requests this node answered, by kind",
                              ["kind"], registry=self.registry)
        self.ttft = Histogram("ringlet_time_to_first_token_seconds", "From a request's start to its first output",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("ringlet_inter_token_latency_seconds", "Between two outputs of a stream",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(NodeCollector(node, admission))

    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

    def clock(self) -> RequestClock:
        """A clock for one generation's outputs (:class:`RequestClock`)."""
        return RequestClock(self)


class CountRequests:
    """ASGI middleware: each response counted in ``metrics.requests`` by surface and status
    (outermost, so the guard's 401, 413 and 429 count too)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        surface = surface_of(scope.get("path", "")) if scope.get("type") == "http" else None
        if surface is None:
            await self.app(scope, receive, send)
            return

        async def counted(message) -> None:
            if message.get("type") == "http.response.start":
                self.metrics.requests.labels(surface, str(message.get("status", 0))).inc()
            await send(message)

        await self.app(scope, receive, counted)


class RequestClock:
    """Times one generation's outputs into :class:`Metrics`' histograms and counts its
    tokens (``output()`` at each output, ``usage(...)`` once at its end)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def output(self) -> None:
        """An output (a token or a few) went out now."""
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        self.first, self.last = False, now

    def usage(self, prompt: int, cached: int, completion: int) -> None:
        """The request's token counts."""
        self.metrics.tokens.labels("prompt").inc(prompt)
        self.metrics.tokens.labels("cached").inc(cached)
        self.metrics.tokens.labels("completion").inc(completion)
