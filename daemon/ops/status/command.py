"""``ringlet status``: the snapshot as plain text (or JSON with ``--json``) and its exit status.

Exit status of ``ringlet status``: 0 every stage of the plan is ready or serving,
1 no node answered, 2 bad input, 3 reachable but some stage is not ready
(loading, suspect, unreachable, ...), a member cannot reach an address the plan names, or (a
node serving several models) some model is not serving (starting, planning, left out, ...).
"""

from __future__ import annotations

import json
import sys

from ringlet.daemon.cluster.routes import status_lines as route_lines
from ringlet.daemon.ops.status.collector import take_snapshot
from ringlet.daemon.ops.status.model_rings import ring_text, why_text
from ringlet.daemon.ops.status.urls import default_api_url
from ringlet.daemon.ops.status.values import as_num

EXIT_OK, EXIT_UNREACHABLE, EXIT_BAD_INPUT, EXIT_DEGRADED = 0, 1, 2, 3


def exit_status(snap: dict) -> int:
    """0 healthy, 1 no node answered, 3 reachable but some stage not ready."""
    if not snap["reachable"]:
        return EXIT_UNREACHABLE
    return EXIT_OK if snap["healthy"] else EXIT_DEGRADED


def format_status(snap: dict) -> str:
    """The snapshot as plain text: a summary line and one aligned row per node, never
    truncated (for people and ``grep``)."""
    from ringlet.daemon.ops.format import (
        fmt_bandwidth,
        fmt_batch,
        fmt_bytes,
        fmt_range,
        fmt_rate,
        fmt_seconds,
        policy_text,
    )

    if not snap["reachable"]:
        hint = ("\nno daemon answers there: start one (ringlet run), wait a few seconds if it is starting, "
                "or name another node with --api URL") if "connection refused" in str(snap["error"]) else ""
        return f"unreachable: {snap['error']}{hint}\n"
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
    rows = [("stage", "node", "version", "state", "layers", "memory", "tok/s", "batch", "compute", "prefix", "grpc",
             "api")]
    for n in snap["nodes"]:
        mem = fmt_bytes(n["memory_used_bytes"]).replace(" ", "")
        if n["memory_total_bytes"]:
            mem += "/" + fmt_bytes(n["memory_total_bytes"]).replace(" ", "")
        rows.append((v(n["stage"]), n["name"], version_text(n), v(n["state"]),
                     fmt_range(n["layer_range"]).replace(" ", ""), mem,
                     fmt_rate(n["tokens_per_s"]), fmt_batch(n.get("batch_mean"), n.get("max_batch")),
                     (n.get("compute") or "—").replace(" · ", "/").replace(" ", "-"), prefix_text(n), n["address"],
                     v(n["api_url"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    lines += models_lines(snap.get("models") or [])
    if (kv := c.get("kv_migration")) is not None:
        moved = kv["kv_bytes_received"] + kv["precopied_bytes"]
        lines.append(f"re-plan to epoch {kv['epoch']}: KV moved {fmt_bytes(moved)} "
                     f"({fmt_bytes(kv['precopied_bytes'])} of it while preparing) · "
                     f"{kv['resumed']} request(s) resumed · {kv['rebuilt_tokens']} token(s) of lost layers rebuilt · "
                     f"{kv['reprefilled_tokens']} token(s) prefilled again ({kv['full_reprefills']} full "
                     "re-prefill(s))")
    if (spec := c.get("speculation")) is not None:
        lines.append(spec_text(spec))
    if mixed := releases_line(snap["nodes"]):
        lines.append(mixed)
    for x in c.get("incompatible") or []:  # another wire protocol version: never in the ring
        lines.append(f"kept out: {x.get('reason') or x.get('node_id')}")
    negotiation = c.get("negotiation") if isinstance(c.get("negotiation"), dict) else {}
    for node_id, model in sorted((negotiation.get("kept_out") or {}).items()):
        lines.append(f"kept out of the plan: {node_id} serves {model}, not the cluster's model")
    lines += route_lines(c.get("routes") or [])
    for n in snap["nodes"]:
        if d := n.get("download"):
            lines.append(f"downloading on {n['name']}: {d['file'] or 'files'} · {fmt_bytes(d['bytes_done'])} of "
                         f"{fmt_bytes(d['bytes_total'])} · {fmt_bandwidth(d['rate_bytes_per_s'])} · ETA "
                         f"{fmt_seconds(d['eta_s'])}")
    for n in snap["nodes"]:
        if n.get("network_waiting"):
            lines.append(f"waiting for a network address on {n['name']}: {n['network_waiting']}")
    for p in snap.get("prefilling") or []:
        lines.append(f"prefilling {str(p.get('request_id', ''))[:8]}: {v(p.get('processed_tokens'))} of "
                     f"{v(p.get('prompt_tokens'))} prompt tokens ({v(p.get('cached_tokens'))} cached) · ETA "
                     f"{fmt_seconds(as_num(p.get('eta_s')))}")
    for n in snap["nodes"]:
        if n.get("compute_fix"):
            lines.append(f"slow path on {n['name']}: {n['compute_fix']}")
    for n in snap["nodes"]:  # which rule set each node's usable memory (#43)
        if n.get("memory_usable_source"):
            lines.append(f"memory of {n['name']}: {fmt_bytes(n['memory_usable_bytes'])} for the planner · "
                         f"{n['memory_usable_source']}")
    for n in snap["nodes"]:
        if p := n.get("memory_pressure"):
            cut = f" · offering {fmt_bytes(as_num(p.get('offered_bytes')))}" if p.get("offered_bytes") else ""
            lines.append(f"memory pressure on {n['name']} for {as_num(p.get('for_s')) or 0:.0f} s: "
                         f"{p.get('reason')} · shed {fmt_bytes(as_num(p.get('shed_bytes')))}{cut}")
    if snap["error"]:
        lines.append(f"not reached: {snap['error']}")
    return "\n".join(lines) + "\n"


def models_lines(models: list[dict]) -> list[str]:
    """A node serving several models: each one's priority, name, state, ring (or why it is
    left out) and what it holds and is offered on the node asked (``[]``: one model)."""
    from ringlet.daemon.ops.format import fmt_bytes

    if not models:
        return []
    lines = ["models (priority order, each its own ring; the table above is the first one's):"]
    for m in models:
        name = m["name"] + (f" (alias{'es' if len(m['aliases']) > 1 else ''} {', '.join(m['aliases'])})"
                            if m["aliases"] else "")
        head = [f"{m['priority'] + 1} {name}"]
        if m.get("model") and m["model"] not in (m["name"], m["key"]):
            head.append(f"from {m['model']}")
        head.append(m["state"] or "—")
        if m.get("num_layers") is not None:
            head.append(f"{m['num_layers']} layers")
        if m.get("epoch") is not None:
            head.append(f"epoch {m['epoch']}")
        if m.get("requests_in_flight") is not None:
            head.append(f"in flight {m['requests_in_flight']}")
        if m.get("restarts"):
            head.append(f"restarted {m['restarts']}×")
        lines.append("  " + " · ".join(head))
        lines.append(f"    ring: {ring_text(m)}" if m["stages"] else f"    why: {why_text(m)}" if why_text(m)
                     else "    no plan yet")
        share = "offered all (the first model)" if m["share_bytes"] is None and m["priority"] == 0 else (
            f"offered {fmt_bytes(m['share_bytes'])}")
        reserved = f" · reserving {fmt_bytes(m['reserved_bytes'])} for a load" if m.get("reserved_bytes") else ""
        lines.append(f"    on {m['node'] or 'this node'}: holds {fmt_bytes(m['footprint_bytes'])} · {share}{reserved}")
    return lines


def version_text(node: dict) -> str:
    """A node's release and wire protocol, e.g. ``0.2.0/p1`` (``—`` when not reported)."""
    if node.get("release") is None:
        return "—"
    return f"{node['release']}/p{node['protocol_version'] if node.get('protocol_version') is not None else '?'}"


def releases_line(nodes: list[dict]) -> str | None:
    """``releases: 0.2.0 on 2 nodes, 0.1.0 on 1`` when the nodes run more than one release
    (a rolling upgrade under way), else ``None``."""
    counts: dict[str, int] = {}
    for n in nodes:
        if n.get("release") is not None:
            counts[version_text(n)] = counts.get(version_text(n), 0) + 1
    if len(counts) < 2:
        return None
    parts = [f"{r} on {k} node{'s' if k > 1 else ''}" for r, k in sorted(counts.items(), key=lambda kv: kv[0],
                                                                         reverse=True)]
    return "releases: " + ", ".join(parts) + " (mixed: each plan uses only what every node taking part speaks)"


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


def prefix_text(node: dict) -> str:
    """A node's prefix store in one cell: bytes held (and on disk), then hits/misses
    (``12MiB:5h/1m``, ``12MiB+1.2GiBdisk:5h/1m``)."""
    if node.get("prefix_bytes") is None:
        return "—"
    from ringlet.daemon.ops.format import fmt_bytes

    disk = f"+{fmt_bytes(node['prefix_disk_bytes']).replace(' ', '')}disk" if node.get("prefix_disk_bytes") else ""
    return (f"{fmt_bytes(node['prefix_bytes']).replace(' ', '')}{disk}:{node.get('prefix_hits') or 0}h/"
            f"{node.get('prefix_misses') or 0}m")


def spec_text(spec: dict) -> str:
    """The cluster's speculative decoding in one line: tokens per trip around the ring,
    acceptance of the drafted tokens, over how many trips."""
    rate = spec.get("acceptance")
    return (f"speculative decoding: {spec['tokens_per_trip']:.2f} tokens per trip · "
            f"{'—' if rate is None else f'{rate:.0%}'} of {spec['drafted']} drafted tokens accepted · "
            f"{spec['trips']} trips")
