"""The planner's output: a frozen :class:`Plan` with a stable id and a JSON form.

Units: bytes, seconds, bytes/s; ``time_s`` is seconds per decoded token.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``node_id`` holds layers ``[start, end)``.

    Attributes:
        node_id: the node.
        start, end: half-open layer range, ``0 <= start < end <= num_layers``.
        time_s: predicted seconds per decoded token (memory term + compute term).
        memory_bytes: weights + KV cache at the plan's context (+ embedding / head).
        capacity_bytes: the node's usable memory.
        load_bytes: weight bytes the node must load that it did not hold under the
            previous plan (everything it holds when there is no previous plan).
        embeds: holds the token embedding (first stage; also the last with tied embeddings).
        heads: holds the final norm and output head (last stage).
    """

    node_id: str
    start: int
    end: int
    time_s: float
    memory_bytes: int
    capacity_bytes: int
    load_bytes: int
    embeds: bool = False
    heads: bool = False

    @property
    def num_layers(self) -> int:
        """Layers in the stage."""
        return self.end - self.start


@dataclass(frozen=True)
class Hop:
    """A transfer between consecutive stages (or the token's return to stage 0).

    Attributes:
        src, dst: node ids.
        path: nodes traversed, ``(src, ..., dst)``; longer than 2 for a routed return.
        kind: ``"direct"`` (a measured link), ``"fallback"`` (default network) or ``"routed"``.
        payload_bytes: bytes per token (hidden state forward, token id on return).
        bandwidth_bytes_per_s: the slowest edge on the path.
        latency_s: summed latency of the path.
        time_s: predicted seconds per token: sum over edges of latency + payload / bandwidth.
        returns: True for the last stage -> first stage hop.
    """

    src: str
    dst: str
    path: tuple[str, ...]
    kind: str
    payload_bytes: int
    bandwidth_bytes_per_s: float
    latency_s: float
    time_s: float
    returns: bool = False

    @property
    def occupancy_s(self) -> float:
        """Seconds the slowest edge is busy per token (limits pipelined throughput)."""
        return self.payload_bytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0


@dataclass(frozen=True)
class ExcludedNode:
    """A node left out of the plan: ``code`` is machine-readable, ``reason`` is for people.

    Codes: ``zero_memory``, ``zero_bandwidth``, ``zero_compute``, ``too_small``
    (cannot hold a single layer), ``too_many_nodes`` (more nodes than layers),
    ``not_in_ring_order`` (pinned ring order omits it), ``not_needed`` (the policy's
    objective is no better with it).
    """

    node_id: str
    code: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """A pipeline plan: the ring order and one contiguous layer range per stage.

    Attributes:
        policy: the policy that chose it.
        model_name, model_fingerprint: the model (see ``ModelSpec.fingerprint``).
        num_layers: decoder layers of the model; the stages cover ``[0, num_layers)``.
        context_tokens: the context the KV cache is sized for.
        stages: in ring order; ``stages[0]`` embeds, ``stages[-1]`` samples.
        hops: ``len(stages) - 1`` forward hops, then the return hop (none for one stage).
        excluded: nodes left out, each with the reason (sorted by node id).
        latency_s: predicted seconds per token for one request: stage times + hop times.
        throughput_tokens_per_s: upper bound on aggregate tokens/s with the pipeline
            full (1 / the busiest stage or link); None if every time is 0.
        notes: human explanations of choices (fallbacks, re-chosen ring, ...).
        plan_id: hex hash of the model, context and assignment (ring, ranges) --
            equal ids mean equal assignments.
    """

    policy: str
    model_name: str
    model_fingerprint: str
    num_layers: int
    context_tokens: int
    stages: tuple[Stage, ...]
    hops: tuple[Hop, ...]
    excluded: tuple[ExcludedNode, ...]
    latency_s: float
    throughput_tokens_per_s: float | None
    notes: tuple[str, ...] = ()
    plan_id: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan_id", compute_plan_id(self))

    # --- views ------------------------------------------------------------------------

    @property
    def ring_order(self) -> tuple[str, ...]:
        """Node ids in ring order."""
        return tuple(s.node_id for s in self.stages)

    @property
    def ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(node_id, start, end)`` per stage."""
        return tuple((s.node_id, s.start, s.end) for s in self.stages)

    @property
    def max_stage_time_s(self) -> float:
        """The slowest stage's seconds per token (the balanced policy's objective)."""
        return max(s.time_s for s in self.stages)

    @property
    def load_bytes(self) -> int:
        """Bytes all nodes together must load (see :attr:`Stage.load_bytes`)."""
        return sum(s.load_bytes for s in self.stages)

    def stage_for(self, node_id: str) -> Stage | None:
        """The stage of ``node_id``, or None if it is not in the ring."""
        for s in self.stages:
            if s.node_id == node_id:
                return s
        return None

    def stage_for_layer(self, layer: int) -> Stage:
        """The stage holding ``layer``. Raises IndexError outside ``[0, num_layers)``."""
        for s in self.stages:
            if s.start <= layer < s.end:
                return s
        raise IndexError(f"layer {layer} is outside [0, {self.num_layers})")

    # --- JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-safe dict (no NaN/inf; ``json.dumps`` works); :meth:`from_dict` inverts it."""
        return {
            "format": PLAN_FORMAT,
            "plan_id": self.plan_id,
            "policy": self.policy,
            "model": {
                "name": self.model_name,
                "fingerprint": self.model_fingerprint,
                "num_layers": self.num_layers,
                "context_tokens": self.context_tokens,
            },
            "stages": [
                {
                    "node_id": s.node_id,
                    "start": s.start,
                    "end": s.end,
                    "time_s": s.time_s,
                    "memory_bytes": s.memory_bytes,
                    "capacity_bytes": s.capacity_bytes,
                    "load_bytes": s.load_bytes,
                    "embeds": s.embeds,
                    "heads": s.heads,
                }
                for s in self.stages
            ],
            "hops": [
                {
                    "src": h.src,
                    "dst": h.dst,
                    "path": list(h.path),
                    "kind": h.kind,
                    "payload_bytes": h.payload_bytes,
                    "bandwidth_bytes_per_s": _finite_or_none(h.bandwidth_bytes_per_s),
                    "latency_s": h.latency_s,
                    "time_s": h.time_s,
                    "returns": h.returns,
                }
                for h in self.hops
            ],
            "excluded": [{"node_id": x.node_id, "code": x.code, "reason": x.reason} for x in self.excluded],
            "predicted": {
                "latency_s": self.latency_s,
                "throughput_tokens_per_s": self.throughput_tokens_per_s,
                "max_stage_time_s": self.max_stage_time_s,
            },
            "load_bytes": self.load_bytes,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """``json.dumps(self.to_dict())``, compact and with sorted keys."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. received from a peer).

        Checks types and that the carried ``plan_id`` matches the content. It does not
        check coverage; call :func:`~.validate.validate_plan` for that.

        Raises:
            ValueError: a missing/mistyped field (named, e.g. ``stages[2].end``), an
                unsupported format, or a ``plan_id`` that does not match.
        """
        r = _Reader(data, "plan")
        fmt = r.int("format")
        if fmt != PLAN_FORMAT:
            raise ValueError(f"plan.format {fmt} is not supported (expected {PLAN_FORMAT})")
        model = r.sub("model")
        stages = tuple(
            Stage(
                node_id=s.str("node_id"),
                start=s.int("start"),
                end=s.int("end"),
                time_s=s.float("time_s"),
                memory_bytes=s.int("memory_bytes"),
                capacity_bytes=s.int("capacity_bytes"),
                load_bytes=s.int("load_bytes"),
                embeds=s.bool("embeds"),
                heads=s.bool("heads"),
            )
            for s in r.list("stages")
        )
        hops = tuple(
            Hop(
                src=h.str("src"),
                dst=h.str("dst"),
                path=tuple(h.str_list("path")),
                kind=h.str("kind"),
                payload_bytes=h.int("payload_bytes"),
                bandwidth_bytes_per_s=h.float("bandwidth_bytes_per_s", none_is=math.inf),
                latency_s=h.float("latency_s"),
                time_s=h.float("time_s"),
                returns=h.bool("returns"),
            )
            for h in r.list("hops")
        )
        excluded = tuple(
            ExcludedNode(node_id=x.str("node_id"), code=x.str("code"), reason=x.str("reason"))
            for x in r.list("excluded")
        )
        predicted = r.sub("predicted")
        plan = cls(
            policy=r.str("policy"),
            model_name=model.str("name"),
            model_fingerprint=model.str("fingerprint"),
            num_layers=model.int("num_layers"),
            context_tokens=model.int("context_tokens"),
            stages=stages,
            hops=hops,
            excluded=excluded,
            latency_s=predicted.float("latency_s"),
            throughput_tokens_per_s=predicted.float("throughput_tokens_per_s", optional=True),
            notes=tuple(r.str_list("notes")),
        )
        claimed = r.str("plan_id")
        if claimed != plan.plan_id:
            raise ValueError(f"plan.plan_id {claimed!r} does not match the plan's content ({plan.plan_id!r})")
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`. Raises ValueError on bad JSON or content."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def compute_plan_id(plan: Plan) -> str:
    """SHA-256 (first 16 hex digits) of the model fingerprint, context and the ordered
    ``(node_id, start, end)`` triples. Predictions, policy and notes are not part of
    the id: two plans with the same id serve the same layers on the same nodes."""
    blob = json.dumps(
        [PLAN_FORMAT, plan.model_fingerprint, plan.num_layers, plan.context_tokens, [list(r) for r in plan.ranges]],
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _Reader:
    """Typed access to a JSON object; each getter raises ValueError naming the path
    (``plan.stages[2].end``) when the key is missing or has the wrong type."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.where = where

    def _get(self, key: str, optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise ValueError(f"{self.where}.{key} is missing")
        return self.data[key]

    def str(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str):
            raise ValueError(f"{self.where}.{key} must be a string, got {v!r}")
        return v

    def int(self, key: str) -> int:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{self.where}.{key} must be an integer, got {v!r}")
        return v

    def bool(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise ValueError(f"{self.where}.{key} must be true or false, got {v!r}")
        return v

    def float(self, key: str, *, optional: bool = False, none_is: float | None = None) -> float | None:
        v = self._get(key, optional=optional or none_is is not None)
        if v is None:
            if none_is is not None:
                return none_is
            if optional:
                return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{self.where}.{key} must be a finite number, got {v!r}")
        return float(v)

    def sub(self, key: str) -> _Reader:
        return _Reader(self._get(key), f"{self.where}.{key}")

    def list(self, key: str) -> list[_Reader]:
        v = self._get(key)
        if not isinstance(v, list):
            raise ValueError(f"{self.where}.{key} must be a list, got {type(v).__name__}")
        return [_Reader(x, f"{self.where}.{key}[{i}]") for i, x in enumerate(v)]

    def str_list(self, key: str) -> list[str]:
        v = self._get(key)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{self.where}.{key} must be a list of strings, got {v!r}")
        return list(v)
