"""A re-plan never holds two layer ranges beyond what the node offered (#43 must-have 2):
three daemons in memory cgroups of 550 MB serve the 10-layer llama of
tests/cgroups.py (48 MiB a layer; each offers ~265 MB: 5 layers); the first stage
is killed, and the survivors must shift to layers they do not hold. Loading those beside
the old range would take a survivor to 6-8 layers; it drops the layers outside its new
range first (an event says so), so no cgroup's peak through the re-plan passes the larger
of the node's two planned footprints. The answers stay mlx-lm's whole model's, and nobody
is OOM-killed."""

from __future__ import annotations

from cgroups import cgroup_ring

from tests.probes.test_cgroup_cluster import complete, token_ids

IDS = {"a": "a000000000000000", "b": "b000000000000000", "c": "c000000000000000"}
LIMITS = dict.fromkeys(IDS, 550_000_000)


def test_a_survivor_that_shifts_drops_its_old_layers_before_loading(tmp_path, cgroup_llama):
    model, want = cgroup_llama
    name_of = {v: k for k, v in IDS.items()}
    with cgroup_ring(tmp_path / "run", model, LIMITS, IDS, ["--context", "256"]) as (c, cg):
        view = c.wait_plan(stages=3)
        assert token_ids(complete(c.api_urls[1])) == want
        before = {name_of[(i := c.cluster_info(k))["node_id"]]: i["memory"]["planned"]["total_bytes"]
                  for k in (1, 2)}
        first = name_of[view["plan_detail"]["stages"][0]["node_id"]]
        victim = list(IDS).index(first)
        survivors = [k for k in range(3) if k != victim]
        for g in cg.values():
            g.reset_peak()
        c.kill(victim)
        after = c.wait_plan(stages=2, min_epoch=view["epoch"] + 1, nodes=survivors, timeout_s=90)
        assert token_ids(complete(c.api_urls[survivors[0]])) == want
        dropped, words = [], []
        for k in survivors:
            info = c.cluster_info(k)
            name = name_of[info["node_id"]]
            bound = max(before.get(name, 0), info["memory"]["planned"]["total_bytes"])
            peak = cg[name].peak()
            assert peak <= bound, (name, peak, bound, info["memory"]["planned"])
            events = [e["message"] for e in info["events"] if e["kind"] == "memory"]
            dropped += [f"{name}: {m}" for m in events if m.startswith("dropping layers outside")]
            words.append(f"{name} {peak / 1e6:.0f}/{bound / 1e6:.0f} MB")
        assert dropped, "no survivor had to drop first: the test's sizes no longer shift a survivor"
        assert {k: g.oom_kills() for k, g in cg.items()} == dict.fromkeys(IDS, 0)
        print(f"\nbefore: {[(s['node_id'][:1], s['start'], s['end']) for s in view['plan_detail']['stages']]}, "
              f"after: {[(s['node_id'][:1], s['start'], s['end']) for s in after['plan_detail']['stages']]}; "
              f"peak/bound through the re-plan: {', '.join(words)}; {dropped}")
