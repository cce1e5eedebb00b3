"""Planned against measured memory (#43): what each node planned to hold (``/v1/cluster``
``memory.planned.total_bytes``: runtime, stage at the planned context, stores, work
space) beside what its memory cgroup held at its peak (``memory.max_usage_in_bytes``,
reset before each phase), at three moments:

* **load**: the ring formed, nothing asked yet;
* **full context**: a request whose prompt and answer fill the planned context;
* **re-plan**: one node's limit lowered while it serves (it shrinks; the others take
  its layers), from the lowering to the committed plan — the time it took is reported.

Two models, each on daemons in cgroups (cgroup v1 memory controller, root):

* the bundled SmolLM2-135M (dequantized to float32, 538 MB), 2 daemons of 850 MB;
* a random float32 llama of 4.2 GB (24 layers of 176 MB: hidden 2048, MLP 5632, 32 heads
  of 64, 4 KV heads; the tests' 98-token vocabulary), 3 daemons of 1.8, 3.4 and 3.4 GB —
  the cgroups of the issue.

Reported per node and phase: planned MB (through the re-plan, the larger of the old and the
new plan's), peak MB, peak/planned (<= 1 is the goal), and the OOM kills (0). Run: ``python bench/run.py bench_memory``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MB = 1_000_000
BIG = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 5632,
       "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
       "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 98}


def _phase(c, cg: dict, names: list[str], before: dict | None = None) -> dict:
    """Each node's planned total and its cgroup's peak since the last reset, MB; through a
    re-plan (``before``: the phase before it) the planned figure is the larger of the two
    plans' (a node holds its old stage until the new one is committed)."""
    out = {}
    for i in c.alive():
        info = c.cluster_info(i)
        name = names[i]
        planned = info["memory"]["planned"]["total_bytes"]
        if before is not None and name in before:
            planned = max(planned, before[name]["planned_mb"] * MB)
        peak = cg[name].peak()
        out[name] = {"planned_mb": round(planned / MB), "peak_mb": round(peak / MB),
                     "peak_over_planned": round(peak / planned, 3)}
    return out


def _run(model: str, limits: dict[str, int], context: int, prompt_tokens: int, vocab: int, lower: tuple[str, int],
         extra: list[str]) -> dict:
    from cgroups import CgroupCluster, cgroups, require_cgroups

    from ringlet.daemon.errors import RingletError

    parent = require_cgroups()
    names = list(limits)
    result: dict = {"limits_mb": {k: v // MB for k, v in limits.items()}, "context": context}
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-memory-") as tmp, cgroups(parent, limits) as cg, \
            CgroupCluster(len(names), model=model, dynamic=True, cgroups=[cg[k] for k in names], log_dir=tmp,
                          extra_args=["--context", str(context), *extra]) as c:
        view = c.wait_plan(stages=len(names), timeout_s=600)
        result["plan"] = [(s["start"], s["end"]) for s in view["plan_detail"]["stages"]]
        result["load"] = _phase(c, cg, names)
        for g in cg.values():
            g.reset_peak()
        prompt = [(7 * i) % (vocab - 10) + 5 for i in range(prompt_tokens)]  # and 15 answered: the context
        t0 = time.monotonic()
        resp = httpx.post(f"{c.api_urls[0]}/v1/completions", timeout=1200, json={
            "prompt": prompt, "max_tokens": context - prompt_tokens - 1, "temperature": 0})
        result["full_context_s"] = round(time.monotonic() - t0, 1)
        result["full_context_status"] = resp.status_code
        result["full context"] = _phase(c, cg, names)
        for g in cg.values():
            g.reset_peak()
        name, nbytes = lower
        cg[name].limit(nbytes // 4096 * 4096)
        t0 = time.monotonic()
        try:
            after = c.wait_plan(min_epoch=view["epoch"] + 1, timeout_s=120)
        except RingletError as exc:  # the lowered limit still holds the stage, or nothing fits
            result["replan_s"], result["plan_after"] = None, str(exc)[:300]
        else:
            result["replan_s"] = round(time.monotonic() - t0, 1)
            result["plan_after"] = [(s["start"], s["end"]) for s in after["plan_detail"]["stages"]]
        result["re-plan"] = _phase(c, cg, names, result["full context"])
        result["oom_kills"] = {k: g.oom_kills() for k, g in cg.items()}
    return result


def main() -> dict:
    from tiny_models import make_chat_model

    results = {}
    results["smollm2-135m float32"] = _run(
        None, {"a": 850 * MB, "b": 850 * MB}, context=1024, prompt_tokens=1008, vocab=49152,
        lower=("b", 780 * MB), extra=["--dtype", "float32"])
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-big-") as tmp:
        path = make_chat_model("llama", Path(tmp) / "model", BIG)
        results["llama 4.2 GB float32"] = _run(
            str(path), {"a": 1_800 * MB, "b": 3_400 * MB, "c": 3_400 * MB}, context=512, prompt_tokens=496,
            vocab=98, lower=("c", 2_000 * MB), extra=[])
    for model, r in results.items():
        print(f"{model}: plan {r['plan']} -> {r['plan_after']} (re-planned {r['replan_s']} s after the limit fell); "
              f"full context {r['full_context_s']} s ({r['full_context_status']}); OOM kills {r['oom_kills']}")
        for phase in ("load", "full context", "re-plan"):
            print(f"  {phase:13s} " + "  ".join(f"{k} {v['peak_mb']}/{v['planned_mb']} MB ({v['peak_over_planned']})"
                                             for k, v in r[phase].items()))
    Path(__file__).with_name("results_memory.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
