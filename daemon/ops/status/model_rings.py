"""Several models on one node (issue #45): each model's ring, for ``ringlet status`` and the dashboard.

A node started with several ``--model`` answers ``/v1/cluster`` with its first model's view
plus ``models``: per model (priority order) its state, its plan, why it is left out, and what
it holds and is offered on that node (:mod:`ringlet.daemon.api.front`). Each model runs its
own ring with its own node ids, so a stage of a later model is named after the machine that
runs it: the member whose own report of that model holds the stage's layers (same epoch),
else the member at the stage's host and port less the model's priority (lane *i* binds the
node's ``--port`` + *i*), else the only member at its host; else its node id.

:func:`models_of` is pure. A snapshot model::

    {"priority" (0 = first), "name" (the id it serves, else its key), "model" (the --model
     value), "key", "aliases", "state" ("starting", "planning", "serving", "left out",
     "restarting", "stopping"), "infeasible" (why it is left out, or None), "epoch",
     "num_layers", "requests_in_flight" (over every member that reported it), "restarts",
     (``state`` may also be "failed": its process keeps exiting at start, not restarted)
     "node" (the name of the node the figures below are of), "footprint_bytes" (planned
     there), "reserved_bytes" (reserved for a load in progress), "share_bytes" (offered to
     it there; None: the first model, offered all), "stages": [{"stage", "node_id",
     "address", "name", "layer_range", "footprint_bytes" (planned on that member)}]}
"""

from __future__ import annotations

from ringlet.daemon.ops.status.values import as_int, as_range, as_str, dicts, sum_known

__all__ = ["models_of", "ring_text", "why_text"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")  # noqa: S104 - compared, never bound


def _host_port(address: str | None) -> tuple[str, int | None]:
    host, _, port = (address or "").rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def models_of(primary: str, infos: dict[str, dict], nodes: list[dict]) -> list[dict]:
    """The ``models`` of ``infos[primary]`` normalised (schema: module docstring); ``[]`` when
    the node serves one model. ``nodes`` are the snapshot's nodes (their names)."""
    base = infos.get(primary) or {}
    raw = dicts(base.get("models"))
    if not raw:
        return []
    by_url = {n["api_url"]: n for n in nodes if n.get("api_url")}
    by_addr = {n["address"]: n for n in nodes if n.get("address")}
    here = by_url.get(primary.rstrip("/"))
    out = []
    for i, m in enumerate(raw):
        key = as_str(m.get("key")) or as_str(m.get("model")) or str(i)
        priority = as_int(m.get("priority"))
        priority = i if priority is None else priority
        epoch = as_int(m.get("epoch"))
        # each member's own report of this model: (its snapshot node, its entry)
        reports = []
        for url, info in infos.items():
            entry = next((e for e in dicts(info.get("models")) if as_str(e.get("key")) == key), None)
            if entry is not None:
                reports.append((by_url.get(url.rstrip("/")), entry))
        stages = []
        for s, st in enumerate(dicts(m.get("plan"))):
            rng = as_range([st.get("start"), st.get("end")])
            node_id, address = as_str(st.get("node_id")), as_str(st.get("address"))
            node, entry = _whose(reports, rng, epoch, node_id, address)
            if node is None:
                node = _by_address(address, priority, by_addr, nodes)
            stages.append({"stage": s, "node_id": node_id, "address": address, "layer_range": rng,
                           "name": node["name"] if node else (node_id or "")[:8] or address or "?",
                           "footprint_bytes": as_int(entry.get("footprint_bytes")) if entry else None})
        out.append({
            "priority": priority, "name": as_str(m.get("served")) or key, "model": as_str(m.get("model")),
            "key": key, "aliases": [a for a in m.get("aliases") or [] if isinstance(a, str)] if isinstance(
                m.get("aliases"), list) else [],
            "state": as_str(m.get("state")), "infeasible": as_str(m.get("infeasible")), "epoch": epoch,
            "num_layers": as_int(m.get("num_layers")),
            "requests_in_flight": sum_known([as_int(e.get("requests_in_flight")) for _, e in reports]),
            "restarts": as_int(m.get("restarts")), "node": here["name"] if here else None,
            "footprint_bytes": as_int(m.get("footprint_bytes")), "reserved_bytes": as_int(m.get("reserved_bytes")),
            "share_bytes": as_int(m.get("share_bytes")), "stages": stages,
        })
    return out


def _whose(reports: list[tuple[dict | None, dict]], rng: list[int] | None, epoch: int | None,
           node_id: str | None, address: str | None) -> tuple[dict | None, dict | None]:
    """The member (and its report) that runs a stage: the one whose report names the stage's
    node id or address, else the only one holding its layers at the model's epoch."""
    for node, entry in reports:
        if (node_id and as_str(entry.get("node_id")) == node_id) or (
                address and as_str(entry.get("address")) == address):
            return node, entry
    if rng is None:
        return None, None
    holding = [(node, entry) for node, entry in reports if as_range(entry.get("layer_range")) == rng
               and (epoch is None or as_int(entry.get("epoch")) in (None, epoch))]
    return holding[0] if len(holding) == 1 else (None, None)


def _by_address(address: str | None, priority: int, by_addr: dict[str, dict], nodes: list[dict]) -> dict | None:
    host, port = _host_port(address)
    if port is not None and (node := by_addr.get(f"{host}:{port - priority}") or by_addr.get(
            f"[{host}]:{port - priority}")):
        return node
    if host in _LOOPBACK:
        return None
    at_host = [n for n in nodes if _host_port(n.get("address"))[0] == host]
    return at_host[0] if len(at_host) == 1 else None


def why_text(model: dict) -> str | None:
    """Why a model has no ring: the reason it is left out, or that its process cannot start
    on the node asked (state ``failed``); ``None`` otherwise."""
    if model.get("infeasible"):
        return model["infeasible"]
    if model.get("state") == "failed":
        return f"its process keeps exiting at start on {model.get('node') or 'this node'} (its log says why)"
    return None


def ring_text(model: dict) -> str:
    """A model's ring in one line: ``vm-a [0, 16) → vm-b [16, 30)``; else why it has none
    (:func:`why_text`), else ``no plan yet``."""
    if model.get("stages"):
        return " → ".join(f"{s['name']} [{s['layer_range'][0]}, {s['layer_range'][1]})" if s["layer_range"]
                          else s["name"] for s in model["stages"])
    return why_text(model) or "no plan yet"
