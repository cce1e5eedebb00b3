"""Three daemons in memory cgroups of unequal limits and a random llama bigger than any one of
them (#43): the plan gives no node more than its cgroup allows, and no node holds more than
it planned (the cgroup's peak at load, at a request that fills the planned context and
through a re-plan, and MLX's peak, never exceed the node's planned footprint); the greedy
answer is mlx-lm's whole model's; a limit lowered while the ring serves re-plans and it
keeps answering; one node killed: the other two cannot hold the model and answer 503 with
the reason, and nobody is OOM-killed; restarted, the ring serves the same answer again.

Sizes: 10 layers of 48 MiB (float32: hidden 1024, MLP 3072, 8 query and 2 key/value heads)
and a 98-token vocabulary, 483 MB in all. A node offers the planner 80 % of its limit less
its runtime (~90 MiB measured, and 32 MiB it grows by once serving), less the boundary
budget (a sixteenth) and one step's activations (29.1 MB: tests/engine/test_work_space.py):
~265 MB (5 layers) at 550 MB, ~138 MB (2 layers) at 380 MB. The cgroups are children of this
test's own (tests/cgroups.py), removed afterwards; the model's files are written by the
test, so their page cache is charged to the test's cgroup and a daemon's cgroup peak is what
the daemon itself holds. Node ids are fixed so that c is the last stage (the loopback
planner orders nodes of equal speed by id): it is the one whose limit is lowered, and it
shrinks from the front, keeping layers it holds (a node that moved to a range it does not
hold would hold both while it prepares: #43 must-have 2).
"""

from __future__ import annotations

import time

import httpx
from cgroups import PROMPT, TOKENS, CgroupCluster, cgroup_ring, expected_usable

MB = 1_000_000
LIMITS = {"a": 550_000_000, "b": 550_000_000, "c": 380_000_000}
IDS = {"a": "a000000000000000", "b": "b000000000000000", "c": "c000000000000000"}


def complete(url: str, prompt: list[int] = PROMPT, tokens: int = TOKENS) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True})


def planned(c: CgroupCluster) -> dict[str, dict]:
    """Each node's planned footprint (``/v1/cluster`` ``memory.planned``), by node name."""
    name_of = {v: k for k, v in IDS.items()}
    out = {}
    for i in c.alive():
        info = c.cluster_info(i)
        out[name_of[info["node_id"]]] = {**info["memory"]["planned"], "mlx_peak": info["memory"]["mlx_peak_bytes"]}
    return out


def check_footprint(c: CgroupCluster, cg: dict, phase: str, allowed: dict[str, int] | None = None) -> dict[str, str]:
    """No node's cgroup held more than its planned footprint since the peaks were last reset
    (``allowed``: a bound per node instead, for a re-plan), the planned parts add up, and
    MLX's peak stays within the planned stage, stores and work space (the larger plan's
    through a re-plan). Returns the figures in
    words (MB) for the closing print."""
    words = {}
    for name, p in planned(c).items():
        parts = ("runtime_bytes", "stage_bytes", "boundary_bytes", "work_space_bytes", "tokenizer_bytes",
                 "prefix_bytes")
        assert p["total_bytes"] == sum(p[k] for k in parts), p
        bound = (allowed or {}).get(name, p["total_bytes"])
        peak = cg[name].peak()
        assert peak <= bound, (phase, name, peak, p)
        assert p["mlx_peak"] <= bound - p["runtime_bytes"], (phase, name, p)  # MLX's peak: since the daemon started
        words[name] = f"{peak / MB:.0f}/{bound / MB:.0f}"
    return words


def token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def check_plan(view: dict, limits: dict[str, int]) -> dict[str, dict]:
    """Each member's usable memory is its limit's by hand, and no stage is planned more than
    it; returns the stages by node name."""
    name_of = {v: k for k, v in IDS.items()}
    for m in view["members"]:
        name = name_of[m["node_id"]]
        want = expected_usable(limits[name] // 4096 * 4096, m["memory_usable_source"])
        assert m["memory_usable_source"].startswith("cgroup v1 memory.limit_in_bytes ("), m
        assert abs(m["memory_usable_bytes"] - want) <= 1.1 * MB, (name, m, want)
    stages = {name_of[s["node_id"]]: s for s in view["plan_detail"]["stages"]}
    for name, s in stages.items():
        assert s["memory_bytes"] <= s["capacity_bytes"], (name, s)
    return stages


def test_three_limits_a_lowered_one_a_loss_and_a_return(tmp_path, cgroup_llama):
    model, want = cgroup_llama
    with cgroup_ring(tmp_path / "run", model, LIMITS, IDS, ["--context", "256"]) as (c, cg):
        view = c.wait_plan(stages=3)
        limits = dict(LIMITS)
        stages = check_plan(view, limits)
        footprint = {"load": check_footprint(c, cg, "load")}
        assert token_ids(complete(c.api_urls[0])) == want
        # a request that fills the planned context (256 tokens) through every stage
        assert len(token_ids(complete(c.api_urls[0], [(7 * i) % 97 + 1 for i in range(240)], 16))) == 16
        footprint["full context"] = check_footprint(c, cg, "full context")
        before = {k: p["total_bytes"] for k, p in planned(c).items()}
        for g in cg.values():
            g.reset_peak()

        # c's limit lowered above what it holds (~230 MB), to where it offers ~77 MB: one
        # layer, not its two
        assert cg["c"].usage() < 280 * MB
        limits["c"] = cg["c"].limit(300 * MB // 4096 * 4096)
        lowered = time.monotonic()
        after = c.wait_plan(stages=3, min_epoch=view["epoch"] + 1, timeout_s=60)
        replan_s = time.monotonic() - lowered
        shrunk = check_plan(after, limits)
        # through the re-plan no node held more than the larger of its two planned footprints
        bound = {k: max(before[k], p["total_bytes"]) for k, p in planned(c).items()}
        footprint["re-plan"] = check_footprint(c, cg, "re-plan", bound)
        old, new = stages["c"], shrunk["c"]  # fewer layers, all of them held already
        assert old["start"] <= new["start"] < new["end"] <= old["end"], (stages, shrunk)
        assert new["end"] - new["start"] < old["end"] - old["start"], (stages, shrunk)
        assert token_ids(complete(c.api_urls[0])) == want

        c.kill(0)  # a: b and c together hold too little
        deadline = time.monotonic() + 30
        while (resp := complete(c.api_urls[1])).status_code != 503:
            assert resp.status_code == 200 and time.monotonic() < deadline, resp.text
            time.sleep(0.3)
        reason = resp.json()["error"]["message"]
        assert "model needs" in reason and "cluster has" in reason and "add a node or memory" in reason, reason
        assert complete(c.api_urls[2]).json()["error"]["message"] == reason  # every member says the same
        assert c.alive() == [1, 2]

        c.restart(0)
        back = c.wait_plan(stages=3, min_epoch=after["epoch"] + 2, timeout_s=90)
        check_plan(back, limits)
        assert token_ids(complete(c.api_urls[0])) == want
        assert token_ids(complete(c.api_urls[2])) == want
        kills = {k: g.oom_kills() for k, g in cg.items()}
        assert kills == {"a": 0, "b": 0, "c": 0}, kills
        print("\nusable (MB): " + ", ".join(f"{k} {m['memory_usable_bytes'] / MB:.0f}" for k, m in zip(
            IDS, sorted(view["members"], key=lambda m: m["node_id"]), strict=True))
              + "; stages: " + ", ".join(f"{k} [{s['start']},{s['end']}) {s['memory_bytes'] / MB:.0f} MB"
                                         for k, s in stages.items())
              + f"; c lowered to {limits['c'] / MB:.0f} MB: re-planned in {replan_s:.1f} s to "
              + ", ".join(f"{k} [{s['start']},{s['end']})" for k, s in shrunk.items())
              + "; cgroup peak/planned (MB): " + "; ".join(f"{ph} " + ", ".join(f"{k} {v}" for k, v in f.items())
                                                        for ph, f in footprint.items())
              + f"; 503: {reason}; peaks (MB): "
              + ", ".join(f"{k} {g.peak() / MB:.0f}/{int(g.read('memory.limit_in_bytes')) / MB:.0f} "
                          f"(failcnt {g.read('memory.failcnt').strip()})" for k, g in cg.items()))
