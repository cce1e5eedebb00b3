"""Where a re-plan's KV comes from: moved from the layers' previous holder, or rebuilt by
their new holders from the boundary activations entering them.

The proposer decides once, for every stage of the plan it replaces, and the proposal
carries the decision (``LayerRange.rebuild``, ``why``), so every member follows the same
one: the new holders of a rebuilt range compute it in chain, each starting from what the
one before it computed, and need each other to agree.

A holder that is gone took its KV with it: its range is rebuilt. A holder that stopped
(``SIGTERM``, a graceful leave) hands its KV over, so its range moves.
"""

from __future__ import annotations

from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


def mark_rebuilds(previous: list[pb.LayerRange], alive: set[str], departed: dict[str, str]) -> list[pb.LayerRange]:
    """``previous`` (the stages the cluster serves now) with ``rebuild`` and ``why`` set on
    the stages whose node is no longer a member and did not leave gracefully.

    Args:
        previous: the serving plan's stages (modified in place and returned).
        alive: the members the new plan is made for.
        departed: node id -> why it left (``"stopped"``: a graceful leave, its KV moves).
    """
    for stage in previous:
        if stage.node_id and stage.node_id not in alive and departed.get(stage.node_id, "") != "stopped":
            stage.rebuild = True
            stage.why = f"lost ({departed.get(stage.node_id, 'not a member')}): its KV went with it"
    return previous


def rebuilt_spans(previous, num_layers: int) -> list[tuple[int, int]]:
    """The maximal runs ``[a, b)`` of adjacent previous stages marked ``rebuild``."""
    spans: list[tuple[int, int]] = []
    for s in sorted(previous, key=lambda s: s.start):
        if not s.rebuild:
            continue
        if spans and spans[-1][1] == s.start:
            spans[-1] = (spans[-1][0], s.end)
        else:
            spans.append((s.start, s.end))
    return [(a, min(b, num_layers)) for a, b in spans]


def boundary_source(lo: int, span: tuple[int, int], previous, stages):
    """Who holds the states entering layer ``lo`` of the rebuilt ``span``: the previous
    stage that ended at the span's start (it sent them on), or at layer 0 (the input is
    the token ids) the previous stage right after the span (it knows the sequences it
    holds); inside the span, the new stage holding layer ``lo - 1`` (it rebuilds the layers
    before). Returns ``(stage, from_previous_plan)``, or ``(None, False)``: nobody can."""
    a, b = span
    if lo == a:
        want = (lambda s: s.end == a) if a > 0 else (lambda s: s.start == b)
        found = next((s for s in previous if want(s) and not s.rebuild), None)
        return found, True
    holder = next((s for s in stages if s.start <= lo - 1 < s.end), None)
    return holder, False
