"""``ringlet status`` and the dashboard of a node serving several models (#45): the front's
``/v1/cluster`` (the first model's view plus ``models``) gives a snapshot ``models`` list in
priority order, each model's stages named after the machine that runs them (each model's
ring has its own node ids), the reason a model is left out, and what it holds and is offered
on the node asked; the text, the JSON and the dashboard frame show them."""

from __future__ import annotations

import io
import json

from conftest import ringlet
from rich.console import Console
from test_status import FakeNode

from ringlet.daemon.ops.dashboard.frame import render
from ringlet.daemon.ops.status.command import EXIT_DEGRADED, EXIT_OK, exit_status, format_status, models_lines
from ringlet.daemon.ops.status.snapshot import build_snapshot

GIB = 1 << 30
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
REASON = "needs 300 GiB on the cluster; 120 GiB are left beside the models before it"


def machine_info(k: int, *, third: bool = True) -> dict:
    """``/v1/cluster`` of machine ``k`` (0: studio-1, 1: studio-2) serving Llama-3.3-70B first,
    qwen-7b (alias haiku, from a path) second, and big-model left out (when ``third``)."""
    ids = ["1" * 16, "2" * 16]
    plan = [{"node_id": ids[0], "address": "10.0.0.1:7100", "start": 0, "end": 40, "hop_address": None},
            {"node_id": ids[1], "address": "10.0.0.2:7100", "start": 40, "end": 80, "hop_address": None}]
    members = [{"node_id": ids[j], "name": f"studio-{j + 1}", "state": "self" if j == k else "alive",
                "grpc_address": plan[j]["address"], "api_url": (A, B)[j], "memory_total_bytes": 192 * GIB,
                "memory_usable_bytes": 150 * GIB} for j in range(2)]
    # the second model's ring, its own node ids, stage 0 on studio-2 (its gRPC port + 1)
    qwen_plan = [{"node_id": "q" * 16, "address": "10.0.0.2:7101", "start": 0, "end": 14, "hop_address": None},
                 {"node_id": "p" * 16, "address": "10.0.0.1:7101", "start": 14, "end": 28, "hop_address": None}]
    models = [
        {"model": "Llama-3.3-70B", "key": "Llama-3.3-70B", "served": "Llama-3.3-70B", "aliases": [],
         "state": "serving", "footprint_bytes": (70 + k) * GIB, "reserved_bytes": 0, "share_bytes": None,
         "restarts": 0, "pid": 100 + k, "priority": 0, "epoch": 3, "plan": plan, "infeasible": None,
         "layer_range": [plan[k]["start"], plan[k]["end"]], "requests_in_flight": 1 - k, "num_layers": 80},
        {"model": "/models/qwen-7b", "key": "qwen-7b", "served": "qwen-7b", "aliases": ["haiku"],
         "state": "serving", "footprint_bytes": (8 + k) * GIB, "reserved_bytes": 2 * GIB if k == 0 else 0,
         "share_bytes": (80 - k) * GIB, "restarts": 1 if k == 0 else 0, "pid": 200 + k, "priority": 1, "epoch": 5,
         "plan": qwen_plan, "infeasible": None, "layer_range": [[14, 28], [0, 14]][k], "requests_in_flight": 2,
         "num_layers": 28},
    ]
    if third:
        models.append({"model": "big-model", "key": "big-model", "served": None, "aliases": [],
                       "state": "left out", "footprint_bytes": 0, "reserved_bytes": 0, "share_bytes": 12 * GIB,
                       "restarts": 0, "pid": 300 + k, "priority": 2, "epoch": None, "plan": [],
                       "infeasible": REASON, "layer_range": None, "requests_in_flight": None, "num_layers": None})
    return {"node_id": ids[k], "address": plan[k]["address"], "state": "serving", "epoch": 3,
            "model": "Llama-3.3-70B", "num_layers": 80, "layer_range": [plan[k]["start"], plan[k]["end"]],
            "plan": plan, "members": members, "requests_in_flight": 1 - k, "memory": {"rss_bytes": 70 * GIB},
            "models": models}


def snapshot(**kw) -> dict:
    return build_snapshot(A, {A: machine_info(0, **kw), B: machine_info(1, **kw)}, {}, now=1_700_000_100)


def test_each_models_ring_named_after_its_machines():
    snap = snapshot()
    json.dumps(snap)
    llama, qwen, big = snap["models"]
    assert [m["priority"] for m in snap["models"]] == [0, 1, 2]
    assert (llama["name"], qwen["name"], big["name"]) == ("Llama-3.3-70B", "qwen-7b", "big-model")
    assert [(s["name"], s["layer_range"]) for s in llama["stages"]] == [("studio-1", [0, 40]), ("studio-2", [40, 80])]
    # its own node ids: each stage is on the machine whose own report holds its layers
    assert [(s["name"], s["layer_range"], s["node_id"]) for s in qwen["stages"]] == [
        ("studio-2", [0, 14], "q" * 16), ("studio-1", [14, 28], "p" * 16)]
    assert [s["footprint_bytes"] for s in qwen["stages"]] == [9 * GIB, 8 * GIB]  # each machine's own figure
    assert qwen["aliases"] == ["haiku"] and qwen["model"] == "/models/qwen-7b" and qwen["requests_in_flight"] == 4
    # the node asked: what each model holds and is offered there
    assert (qwen["node"], qwen["footprint_bytes"], qwen["share_bytes"], qwen["reserved_bytes"]) == (
        "studio-1", 8 * GIB, 80 * GIB, 2 * GIB)
    assert llama["share_bytes"] is None and llama["footprint_bytes"] == 70 * GIB
    assert big["state"] == "left out" and big["infeasible"] == REASON and big["stages"] == []
    # a model left out: the cluster does not serve everything it was asked to
    assert not snap["healthy"] and exit_status(snap) == EXIT_DEGRADED
    assert snapshot(third=False)["healthy"]


def test_a_stage_of_a_machine_not_answering_is_named_by_its_port_or_host():
    info = machine_info(0)
    snap = build_snapshot(A, {A: info}, {B: "connection refused"})
    assert [s["name"] for s in snap["models"][1]["stages"]] == ["studio-2", "studio-1"]  # gRPC port + priority
    info = machine_info(0)
    info["models"][1]["plan"][0]["address"] = "10.0.0.2:9999"  # a port taken at start: the only member there
    info["models"][1]["plan"][1]["address"] = "127.0.0.1:9998"  # loopback names no machine: the node id
    info["models"][1]["layer_range"] = None  # (nor does studio-1's own report then)
    snap = build_snapshot(A, {A: info}, {B: "connection refused"})
    assert [s["name"] for s in snap["models"][1]["stages"]] == ["studio-2", "pppppppp"]


def test_status_text_says_each_models_ring_state_and_memory():
    text = format_status(snapshot())
    assert models_lines(snapshot()["models"]) == [
        "models (priority order, each its own ring; the table above is the first one's):",
        "  1 Llama-3.3-70B · serving · 80 layers · epoch 3 · in flight 1",
        "    ring: studio-1 [0, 40) → studio-2 [40, 80)",
        "    on studio-1: holds 70.0 GiB · offered all (the first model)",
        "  2 qwen-7b (alias haiku) · from /models/qwen-7b · serving · 28 layers · epoch 5 · in flight 4 · restarted 1×",
        "    ring: studio-2 [0, 14) → studio-1 [14, 28)",
        "    on studio-1: holds 8.0 GiB · offered 80.0 GiB · reserving 2.0 GiB for a load",
        "  3 big-model · left out",
        f"    why: {REASON}",
        "    on studio-1: holds 0 B · offered 12.0 GiB",
    ]
    assert "\n".join(models_lines(snapshot()["models"])) in text
    # one model: no models section, an empty list in the snapshot
    single = machine_info(0)
    del single["models"]
    snap = build_snapshot(A, {A: single}, {})
    assert snap["models"] == [] and "models (" not in format_status(snap)


def frame(snap: dict, width: int, height: int | None = None) -> list[str]:
    console = Console(record=True, width=width, height=height or 200, file=io.StringIO())
    console.print(render(snap, height=height))
    return console.export_text().splitlines()


def test_dashboard_draws_a_line_per_model():
    snap = snapshot()
    snap["recent_requests"] = [{"request_id": f"req{k:05d}", "prompt_tokens": 10, "completion_tokens": 100,
                                "ttft_s": 0.4, "tokens_per_s": 30.0} for k in range(6)]
    snap["events"] = [{"ts": 1_700_000_000 + k, "kind": "join", "message": f"event {k}"} for k in range(12)]
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "ring of Llama-3.3-70B: studio-1 → studio-2 → studio-1" in text
    assert "models: 3, priority order · each its own ring · held/offered on studio-1" in text
    row = {ln.split()[1]: ln for ln in lines if ln.strip()[:2] in ("1 ", "2 ", "3 ") and "·" not in ln.split()[0]}
    assert row["Llama-3.3-70B"].split()[2] == "serving" and "studio-1 [0,40) → studio-2 [40,80)" in row[
        "Llama-3.3-70B"] and row["Llama-3.3-70B"].endswith("70.0GiB/all")
    assert "qwen-7b (haiku)" in row["qwen-7b"] and "studio-2 [0,14) → studio-1 [14,28)" in row["qwen-7b"]
    assert row["qwen-7b"].endswith("8.0/80GiB")
    assert row["big-model"].split()[2:5] == ["left", "out", "needs"]  # its state, then why
    assert row["big-model"].endswith("0.0/12GiB")
    assert "event 11" in text  # the events still fit
    wide = frame(snap, 160)
    qwen = next(ln for ln in wide if "qwen-7b (haiku)" in ln)
    assert "studio-2 [0,14) → studio-1 [14,28) · 4 in flight" in qwen and qwen.rstrip().endswith("8.0/80GiB")
    big = next(ln for ln in wide if "big-model" in ln)
    assert f"left out {REASON}" in big


def test_status_cli_json_and_exit_status_with_several_models():
    def alone(third: bool) -> dict:  # one machine: no other member to poll
        info = machine_info(0, third=third)
        for m in info["models"]:
            m["plan"] = m["plan"][:1]
        info["plan"], info["members"] = info["plan"][:1], info["members"][:1]
        return info

    with FakeNode(alone(third=False)) as ok, FakeNode(alone(third=True)) as degraded:
        r = ringlet("status", "--json", "--api", ok.url, timeout=60)
        assert r.returncode == EXIT_OK, r.stdout + r.stderr
        assert [m["name"] for m in json.loads(r.stdout)["models"]] == ["Llama-3.3-70B", "qwen-7b"]
        r = ringlet("status", "--api", degraded.url, timeout=60)
        assert r.returncode == EXIT_DEGRADED and f"why: {REASON}" in r.stdout and "3 big-model" in r.stdout


def test_a_model_whose_process_cannot_start_says_so():
    info = machine_info(0)
    info["models"][2].update(state="failed", infeasible=None)
    snap = build_snapshot(A, {A: info, B: machine_info(1)}, {})
    assert models_lines(snap["models"])[-3:] == [
        "  3 big-model · failed", "    why: its process keeps exiting at start on studio-1 (its log says why)",
        "    on studio-1: holds 0 B · offered 12.0 GiB"]
    assert exit_status(snap) == EXIT_DEGRADED
    row = next(ln for ln in frame(snap, 120) if "big-model" in ln)
    assert row.split()[2:5] == ["failed", "its", "process"] and "at start on studio-1 (its log says why)" in row
