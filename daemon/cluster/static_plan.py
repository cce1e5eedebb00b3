"""A static plan given on the command line: ``--plan HOST:PORT=START:END,...``.

Stages are listed in ring order; each names the gRPC address of the node holding
the half-open layer range ``[START, END)``. Discovery and negotiation replace this
with negotiated plans; it stays as an explicit override.
"""

from __future__ import annotations

from ringlet.daemon.errors import PlanError
from ringlet.daemon.wire.serving_plan import StageSpec


def parse_plan(text: str) -> list[StageSpec]:
    """Parse ``HOST:PORT=START:END,...`` into stages (ring order).

    Raises:
        PlanError: malformed entries (the message quotes the bad one).
    """
    stages = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        address, sep, rng = entry.rpartition("=")
        host, _, port = address.rpartition(":")
        start_s, colon, end_s = rng.partition(":")
        if not sep or not host or not port.isdigit() or not colon:
            raise PlanError(f"bad plan entry {entry!r}: expected HOST:PORT=START:END, e.g. 127.0.0.1:7001=0:10")
        try:
            start, end = int(start_s), int(end_s)
        except ValueError:
            raise PlanError(f"bad layer range in {entry!r}: START and END must be integers") from None
        if not 0 < int(port) < 65536:
            raise PlanError(f"bad port in {entry!r}")
        stages.append(StageSpec(address=f"{host}:{port}", start=start, end=end))
    if not stages:
        raise PlanError("the plan is empty")
    return stages


def even_plan(addresses: list[str], num_layers: int) -> list[StageSpec]:
    """Split ``num_layers`` as evenly as possible over ``addresses`` (earlier stages get
    the extra layers).

    Raises:
        PlanError: more stages than layers.
    """
    n = len(addresses)
    if n == 0 or n > num_layers:
        raise PlanError(f"cannot split {num_layers} layers over {n} nodes")
    base, extra = divmod(num_layers, n)
    stages, start = [], 0
    for i, address in enumerate(addresses):
        end = start + base + (1 if i < extra else 0)
        stages.append(StageSpec(address=address, start=start, end=end))
        start = end
    return stages


def validate(stages: list[StageSpec], num_layers: int) -> None:
    """Check the stages cover ``[0, num_layers)`` exactly once, in order, each non-empty.

    Raises:
        PlanError: naming the overlap, gap, empty or out-of-range stage.
    """
    expected = 0
    seen = set()
    for i, s in enumerate(stages):
        if s.address in seen:
            raise PlanError(f"stage {i}: node {s.address} appears twice in the plan")
        seen.add(s.address)
        if s.end <= s.start:
            raise PlanError(f"stage {i} ({s.address}): layer range [{s.start}, {s.end}) is empty")
        if s.start < expected:
            raise PlanError(
                f"stage {i} ({s.address}): layer range [{s.start}, {s.end}) overlaps the previous "
                f"stage, which ends at {expected}"
            )
        if s.start > expected:
            raise PlanError(f"stage {i} ({s.address}): layers [{expected}, {s.start}) are in no stage (gap)")
        expected = s.end
    if expected != num_layers:
        if expected > num_layers:
            raise PlanError(f"the plan covers layers up to {expected}, but the model has {num_layers}")
        raise PlanError(f"layers [{expected}, {num_layers}) are in no stage (the model has {num_layers})")
