"""Routes: which of a member's addresses to dial, and which addresses a plan names.

A node may be reached at several addresses, one per advertised interface (Thunderbolt,
Ethernet, Wi-Fi). Each node publishes in its record (see :mod:`.router`, which keeps them):

* ``addresses``: where it may be dialled (``host:port``), its advertised address first;
* ``routes``: per member, the address it dials that member at (``address``, ``None`` when
  none answers) and that link's ``kind``; the member's addresses it has reached
  (``reachable``) and those it could not, with why (``unreachable``: address -> reason),
  of which ``broken`` had answered before (a route that broke, not one that never worked,
  such as the far end of another Thunderbolt cable).

The rules here are pure and the same on every member:

* **An address several nodes hold is never a route** (:func:`candidates`): every Docker
  host's ``172.17.0.1``, a private bridge two hosts share. Dialling it reaches whichever
  host the dialler's own routing picks, often itself.
* **The fastest link first** (:func:`better`): among the addresses that answer, the one on
  the fastest link kind (:data:`~.linkprobe.KINDS`: Thunderbolt before Ethernet before
  Wi-Fi), then the highest measured throughput. The route in use is kept unless another is
  of a faster kind or :data:`SWITCH_FACTOR` times faster, so noise never flips it.
* **Two addresses per stage in a plan** (:func:`stage_addresses`): ``address``, which every
  member can dial (stage 0 takes every member's requests), and ``hop``, the route the stage
  before it uses (the link it measured fastest to this neighbour), when that differs.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ringlet.daemon.cluster.linkprobe import KINDS

#: A measured route replaces the one in use (of the same link kind) only when it is this
#: many times faster: two equal links measured under load differ by less.
SWITCH_FACTOR = 2.0
#: What fixes a node that stands at an address its peers cannot reach.
FIX = "--advertise-host ADDRESS (an address its peers reach) or --interface NAME"


@dataclass(frozen=True)
class RouteOption:
    """One address of a member as this node measured it.

    Attributes:
        address: ``host:port``.
        kind: the link kind (:data:`~.linkprobe.KINDS`).
        bandwidth_bytes_per_s: measured one-way throughput, bytes/s (0: not measured).
    """

    address: str
    kind: str
    bandwidth_bytes_per_s: float = 0.0


def _strings(value: object) -> list[str]:
    """The strings of a list from a peer's record (anything else in it, or instead of it, is
    dropped: records come over the wire)."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list | tuple) else []


def _field(record: object, name: str) -> object:
    return record.get(name) if isinstance(record, dict) else None


def shared_addresses(records: Mapping[str, dict]) -> set[str]:
    """The addresses listed by more than one node's record (``addresses``)."""
    counts = Counter(a for rec in records.values() for a in set(_strings(_field(rec, "addresses"))))
    return {a for a, n in counts.items() if n > 1}


def candidates(member_id: str, records: Mapping[str, dict], known: Sequence[str] = ()) -> list[str]:
    """Where ``member_id`` may be dialled: the addresses its record lists, in its own order,
    then ``known`` (where this node reached it), without any address another node's record
    lists too (``records`` should include this node's own)."""
    own = _strings(_field(records.get(member_id), "addresses"))
    shared = shared_addresses(records)
    return [a for a in dict.fromkeys([*own, *known]) if a not in shared]


def _rank(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else KINDS.index("ethernet")


def better(current: str | None, options: Sequence[RouteOption]) -> RouteOption | None:
    """The route to use among ``options`` (addresses that answered), given the address in
    use ``current``: the fastest kind, then the highest throughput; ``current`` is kept
    unless the best is of a faster kind or :data:`SWITCH_FACTOR` times its throughput.
    ``None`` when ``options`` is empty."""
    if not options:
        return None
    best = max(options, key=lambda o: (_rank(o.kind), o.bandwidth_bytes_per_s, o.address == current))
    now = next((o for o in options if o.address == current), None)
    if now is None or now is best:
        return best
    if _rank(best.kind) > _rank(now.kind):
        return best
    if _rank(best.kind) == _rank(now.kind) and best.bandwidth_bytes_per_s >= SWITCH_FACTOR * now.bandwidth_bytes_per_s:
        return best
    return now


def _route(records: Mapping[str, dict], source: str, target: str) -> dict | None:
    routes = _field(records.get(source), "routes")
    route = routes.get(target) if isinstance(routes, dict) else None
    return route if isinstance(route, dict) else None


def common_address(node_id: str, others: Sequence[str], records: Mapping[str, dict]) -> str | None:
    """An address of ``node_id`` that every node in ``others`` reports reachable (``None``:
    none, or some of them have not said): the one most of them dial it at, then the first
    in its own order."""
    routes = [_route(records, o, node_id) for o in others]
    if not others or any(r is None for r in routes):
        return None
    reach = set.intersection(*(set(_strings(r.get("reachable"))) for r in routes))
    if not reach:
        return None
    used = Counter(a for r in routes if isinstance(a := r.get("address"), str))
    order = _strings(_field(records.get(node_id), "addresses"))
    return min(reach, key=lambda a: (-used[a], order.index(a) if a in order else len(order), a))


def stage_addresses(ids: Sequence[str], ring: Sequence[str], records: Mapping[str, dict],
                    fallback: Callable[[str], str]) -> dict[str, tuple[str, str]]:
    """Each node's addresses in a plan: ``{node_id: (address, hop)}``.

    Args:
        ids: the plan's members.
        ring: the pipeline's stage order (node ids; empty when there is no ring, e.g. a
            tensor plan): ``hop`` is the route the previous stage dials the node at.
        records: every member's record (with ``addresses`` and ``routes``).
        fallback: the address of a node when the records do not settle it (where the
            proposer dials it, or where its peers reach the proposer).

    ``address`` is :func:`common_address` over the other members, else ``fallback``;
    ``hop`` is empty when it equals ``address`` or is unknown.
    """
    out: dict[str, tuple[str, str]] = {}
    for node_id in ids:
        address = common_address(node_id, [o for o in ids if o != node_id], records) or fallback(node_id)
        out[node_id] = (address, "")
    if len(ring) > 1:
        for k, node_id in enumerate(ring):
            route = _route(records, ring[k - 1], node_id)
            hop = route.get("address") if route else None
            if node_id in out and isinstance(hop, str) and hop in _strings(route.get("reachable")) \
                    and hop != out[node_id][0]:
                out[node_id] = (out[node_id][0], hop)
    return out


def route_digest(record: dict) -> str:
    """What of a record's ``addresses`` and ``routes`` plans depend on (addresses, and per
    member the address in use and those reachable; not the figures), as a string."""
    routes = _field(record, "routes")
    digest = {k: [v.get("address"), sorted(_strings(v.get("reachable")))]
              for k, v in (routes.items() if isinstance(routes, dict) else ()) if isinstance(v, dict)}
    return json.dumps([_strings(_field(record, "addresses")), digest], sort_keys=True, default=str)


def unreachable_routes(records: Mapping[str, dict], plan_addresses: set[str] = frozenset()) -> list[dict]:
    """Every address a node reported it could not reach, for ``/v1/cluster`` and ``ringlet
    status``: ``{"from", "to", "address", "error", "via" (the address it reaches that node
    at instead, or None), "in_plan" (the committed plan names it), "broke" (it had answered
    before), "fix"}``, sorted."""
    out = []
    for source, rec in sorted(records.items()):
        routes = _field(rec, "routes")
        for target, route in sorted(routes.items() if isinstance(routes, dict) else ()):
            failed = route.get("unreachable") if isinstance(route, dict) else None
            for address, why in sorted(failed.items() if isinstance(failed, dict) else ()):
                via = route.get("address")
                out.append({"from": source, "to": target, "address": address, "error": str(why),
                            "via": via if isinstance(via, str) else None, "in_plan": address in plan_addresses,
                            "broke": address in _strings(route.get("broken")), "fix": f"start {target} with {FIX}"})
    return out


def describe(entry: Mapping) -> str:
    """One :func:`unreachable_routes` entry as a line for people (missing fields as ``?``)."""
    to, source = str(entry.get("to") or "?"), str(entry.get("from") or "?")
    where = f"{entry.get('address') or '?'} of {to[:8]}" + (" (in the plan)" if entry.get("in_plan") else "")
    error = entry.get("error") or "?"
    line = f"{where} from {source[:8]}: " + (f"stopped answering ({error})" if entry.get("broke") else error)
    fix = entry.get("fix") or f"start {to} with {FIX}"
    if entry.get("via"):
        return f"{line}; reached at {entry['via']} instead (to pin an address: {fix})"
    return f"{line}; no other address of it answers: {fix}"


def status_lines(entries: Sequence[Mapping]) -> list[str]:
    """``ringlet status``'s lines for :func:`unreachable_routes` entries: one each (see
    :func:`describe`) for an address the plan names, one that stopped answering, or a node
    no address of which answers; one line for the rest, addresses that never answered
    from there while another of the node's does (the far end of another Thunderbolt cable)."""
    lines, quiet = [], []
    for e in entries:
        if e.get("in_plan") or e.get("broke") or not e.get("via"):
            lines.append(f"unreachable: {describe(e)}")
        else:
            to, source = str(e.get("to") or "?")[:8], str(e.get("from") or "?")[:8]
            quiet.append(f"{e.get('address') or '?'} of {to} from {source}")
    if quiet:
        lines.append(f"never reached (other addresses of these nodes serve): {', '.join(quiet)}")
    return lines
