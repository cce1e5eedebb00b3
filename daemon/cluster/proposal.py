"""A proposal's parts besides the plan: where each stage stands (its address and its hop
address, :func:`.routes.stage_addresses`), whether they moved since the last commit (a
route broke or a faster one was measured: the proposer re-plans over the addresses that
work), and the one line the proposer logs."""

from __future__ import annotations

from collections.abc import Sequence

from ringlet.daemon.cluster.membership import Membership
from ringlet.daemon.cluster.routes import stage_addresses, unreachable_routes
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.serving_plan import ServingPlan
from ringlet.partitioning import Plan


def proposal_addresses(membership: Membership, ids: Sequence[str], plan: Plan | None) -> list[pb.LayerRange]:
    """Each member's addresses for a proposal of ``plan`` (``grpc_address``: where every
    member dials it; ``hop_address``: where the stage before it does, when that differs),
    from the members' published routes, else where this node dials them."""
    records = {i: membership.record_of(i) or {} for i in ids}
    ring = [s.node_id for s in plan.stages] if plan is not None else []
    got = stage_addresses(ids, ring, records, lambda i: membership.address_of(i) or "")
    return [pb.LayerRange(node_id=i, grpc_address=address, hop_address=hop) for i, (address, hop) in got.items()]


def routes_moved(committed: ServingPlan | None, addresses: Sequence[pb.LayerRange]) -> bool:
    """Whether ``addresses`` name another address (or, in a pipeline, another hop address)
    for a stage of the ``committed`` plan than it holds."""
    if committed is None:
        return False
    by_id = {a.node_id: a for a in addresses}
    pipeline = not committed.is_tensor and not committed.is_hybrid
    for stage in committed.stages:
        new = by_id.get(stage.node_id)
        if new is not None and (new.grpc_address != stage.address
                                or (pipeline and new.hop_address != stage.hop_address)):
            return True
    return False


def readdress(previous: list[pb.LayerRange], addresses: Sequence[pb.LayerRange]) -> list[pb.LayerRange]:
    """``previous`` (the stages a proposal replaces, where members fetch KV from) with each
    node that the proposal names at the address it names: a node whose plan address
    stopped answering is fetched from where it answers now. Changes the ranges in place."""
    by_id = {a.node_id: a.grpc_address for a in addresses if a.grpc_address}
    for stage in previous:
        stage.grpc_address = by_id.get(stage.node_id, stage.grpc_address)
    return previous


def routes_report(records: dict[str, dict], plan: ServingPlan | None) -> list[dict]:
    """Every address a member could not reach (:func:`.routes.unreachable_routes`), marking
    those the committed ``plan`` names."""
    named = {a for s in (plan.stages if plan is not None else ()) for a in (s.address, s.hop_address) if a}
    return unreachable_routes(records, named)


def layout(plan: Plan | None, mode: dict | None) -> str:
    """A proposal's layout in one line for the log."""
    if plan is None:
        return "infeasible"
    if mode and mode.get("mode") == "hybrid":
        return ", ".join(f"{'+'.join(g)} [{a}, {b})" for g, (a, b) in zip(mode["groups"], mode["layer_ranges"],
                                                                          strict=True))
    if mode and mode.get("mode") == "tensor":
        return f"every layer on ranks {', '.join(mode['ranks'])}"
    return str(plan.ranges)
