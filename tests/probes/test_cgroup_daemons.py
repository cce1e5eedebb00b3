"""Real daemons in real memory cgroups (#43): the usable memory a node advertises follows its
cgroup's limit, and a limit lowered while it serves re-plans the cluster, which keeps
answering (tests/cgroups.py: children of this test's own v1 memory cgroup, removed after).

The default model runs as float32 on this CPU (538 MB). Node 0 lives in a cgroup of 1.5 GB,
node 1 where the test runs (80 % of the host's RAM). Node 0 has the higher id, so it is the
last stage, and a lowered limit shrinks its range from the front: it keeps layers it holds
and loads none (a node that moved to a range it does not hold would hold both while it
prepares, which a tight limit does not allow: #43 must-have 2). The expected figures are computed from
the limits written here (the kernel keeps them rounded down to a page) and the runtime the
node names in its ``usable_memory_source``.
"""

from __future__ import annotations

import time

import httpx

from tests.cgroups import CgroupCluster, cgroups, expected_usable, fix_node_ids, require_cgroups

PROMPT = "The capital of France is"
MB = 1_000_000


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def members(view: dict) -> dict[str, dict]:
    return {m["node_id"]: m for m in view["members"]}


def test_usable_memory_follows_the_cgroup_and_a_lowered_limit_replans(tmp_path):
    parent = require_cgroups()
    fix_node_ids(tmp_path, ["f000000000000000", "0000000000000001"])
    with cgroups(parent, {"ringlet-a": 1_500_000_000}) as cg:
        a = cg["ringlet-a"]
        with CgroupCluster(2, dynamic=True, cgroups=[a, None], extra_args=["--context", "512"],
                           log_dir=str(tmp_path)) as c:
            view = c.wait_plan(stages=2)
            a_id = c.cluster_info(0)["node_id"]
            record = members(view)[a_id]
            source = record["memory_usable_source"]
            assert source.startswith(f"cgroup v1 memory.limit_in_bytes ({a.path}): 80% of 1.4 GiB less "), source
            assert abs(record["memory_usable_bytes"] - expected_usable(1_499_996_160, source)) <= 1.1 * MB, record
            other = [m for i, m in members(view).items() if i != a_id][0]
            assert other["memory_usable_source"].startswith("80% of total RAM"), other
            first = complete(c.api_urls[1])  # node 1 heads: node 0's cgroup holds no tokenizer
            assert first.status_code == 200, first.text
            stage = {s["node_id"]: s for s in view["plan_detail"]["stages"]}[a_id]

            # a limit a little above what node 0 holds now: 80 % of it is less than its stage needs
            limit = a.limit((a.usage() + 48 * MB) // 4096 * 4096)
            lowered = time.monotonic()
            after = c.wait_plan(stages=2, min_epoch=view["epoch"] + 1, timeout_s=60)
            replan_s = time.monotonic() - lowered
            record = members(after)[a_id]
            assert abs(record["memory_usable_bytes"] - expected_usable(limit, record["memory_usable_source"])) \
                <= 1.1 * MB, record
            assert record["memory_usable_bytes"] < stage["memory_bytes"], (record, stage)
            new_stage = {s["node_id"]: s for s in after["plan_detail"]["stages"]}[a_id]
            assert new_stage["memory_bytes"] <= record["memory_usable_bytes"], (new_stage, record)
            assert new_stage["end"] - new_stage["start"] < stage["end"] - stage["start"]
            events = [e["message"] for e in c.cluster_info(0)["events"] if e["kind"] == "memory"]
            assert any(e.startswith("usable memory 1.0 GiB -> ") for e in events), events

            again = complete(c.api_urls[1])
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            assert httpx.get(f"{c.api_urls[0]}/healthz", timeout=5).json()["state"] == "ready"
            assert c.alive() == [0, 1] and a.oom_kills() == 0
            print(f"\ncgroup 1.5 GB: usable {members(view)[a_id]['memory_usable_bytes'] / MB:.0f} MB, stage "
                  f"[{stage['start']}, {stage['end']}) planned {stage['memory_bytes'] / MB:.0f} MB; lowered to "
                  f"{limit / MB:.0f} MB: usable {record['memory_usable_bytes'] / MB:.0f} MB, re-planned in "
                  f"{replan_s:.1f} s to [{new_stage['start']}, {new_stage['end']}) planned "
                  f"{new_stage['memory_bytes'] / MB:.0f} MB; cgroup peak {a.peak() / MB:.0f} MB, usage now "
                  f"{a.usage() / MB:.0f} MB")
