"""Speculative decoding benchmark (issue #34): decode tokens/s with drafts on (the
default: where measured to pay), always (on every step a drafter can) and off
(``--spec-tokens 0``), in the same run, on 1 and 3 local daemons (float32, the default
model SmolLM2-135M-Instruct), with acceptance and tokens per trip.

Cases (greedy chat completions, streamed, ``return_token_ids``):

* ``edit``: a ~600-token Python file in the prompt, "rename ``x`` to ``y`` and return
  the whole file" (drafts come from the prompt: prompt lookup);
* ``edit+prediction``: the same with ``prediction`` = the original file (as the issue has it);
* ``edit, prefilled`` and ``edit+prediction, prefilled``: the same two with the answer
  prefilled with ```` ```python ```` (``continue_final_message``), so that this model writes
  the file out -- asked plainly, it describes the functions instead: the echo-heavy output
  of a coding agent;
* ``story``: free text (the drafter should back off);
* ``4 edits``: 4 concurrent edits (different files), aggregate tokens/s.

Definitions: decode tokens/s of one request = (completion tokens - 1) / (arrival of its
last token - arrival of its first token) at the client; for 4 concurrent requests, the
sum over requests of (tokens - 1) over the span from the earliest first token to the
last token. Each figure is the median of ``REPEATS`` runs; one
cluster runs at a time, off and on alternating (off, on, on, off, ...), so load from
elsewhere on the machine tends to fall on both. acceptance = accepted
drafts / drafted tokens and tokens per trip = tokens the verifying steps gave / those
steps, from stage 0's ``/v1/cluster`` ``speculation`` (differences over the case).
Ratios on / off are the result; absolute times depend on what else runs on the machine.

Run: ``python bench/run.py bench_spec``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from ringlet.daemon.node.config import SPEC_ALWAYS_ENV
from ringlet.daemon.ops.demo import LocalCluster

STAGES = (1, 3)
REPEATS = 2
EDIT_TOKENS = 160  # completion cap of an edit (the file is ~600 tokens; a cap keeps the run short)
STORY_TOKENS = 96
CONCURRENT = 4


def python_file(seed: int) -> str:
    """A ~600-token Python module that uses a variable ``x`` throughout."""
    names = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda_",
             "mu", "nu", "xi"][:12]
    out = [f'"""Helpers for module {seed}."""\n\nimport math\n']
    for i, name in enumerate(names):
        out.append(f"\ndef {name}_{seed}(x, scale={i + 1}):\n"
                   f"    \"\"\"Return {name} of x scaled by {i + 1}.\"\"\"\n"
                   f"    if x < 0:\n        x = -x\n"
                   f"    return math.sqrt(x) * scale + {i}\n")
    return "".join(out)


FENCE = "```python"


def edit_message(seed: int) -> tuple[str, str]:
    """The edit's user message, and the original file as it stands in it (the prediction
    the issue names: a client predicts the file unchanged but for its edit)."""
    code = python_file(seed)
    return (f"Rename the variable `x` to `y` in this file and return the whole file, nothing else:\n\n"
            f"{FENCE}\n{code}```", f"{FENCE}\n{code}```")


STORY = "Write a long story about a lighthouse keeper and a storm."


async def _one(client: httpx.AsyncClient, url: str, message: str, max_tokens: int,
               prediction: str | None = None, prefill: str | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if prefill is not None:  # the answer continues it (vLLM's continue_final_message)
        body["messages"].append({"role": "assistant", "content": prefill})
        body.update(continue_final_message=True, add_generation_prompt=False)
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    times: list[float] = []
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices") or ():
                ids = choice.get("token_ids") or (choice.get("delta") or {}).get("token_ids") or []
                times.extend([time.perf_counter()] * len(ids))
    return {"first": times[0], "last": times[-1], "tokens": len(times), "usage": usage}


async def _case(url: str, case: str) -> dict:
    async with httpx.AsyncClient(timeout=900) as client:
        if case == "4 edits":
            reqs = await asyncio.gather(*(_one(client, url, edit_message(10 + i)[0], EDIT_TOKENS // 2)
                                          for i in range(CONCURRENT)))
            span = max(r["last"] for r in reqs) - min(r["first"] for r in reqs)
            return {"tokens_per_s": sum(r["tokens"] - 1 for r in reqs) / span,
                    "tokens": [r["tokens"] for r in reqs]}
        if case == "story":
            r = await _one(client, url, STORY, STORY_TOKENS)
        else:
            message, original = edit_message(1)
            prefill = FENCE if case.endswith("prefilled") else None
            prediction = None if "prediction" not in case else original[len(FENCE):] if prefill else original
            r = await _one(client, url, message, EDIT_TOKENS, prediction, prefill)
        return {"tokens_per_s": (r["tokens"] - 1) / (r["last"] - r["first"]), "tokens": r["tokens"],
                "usage_details": r["usage"].get("completion_tokens_details")}


CASES = ("edit", "edit+prediction", "edit, prefilled", "edit+prediction, prefilled", "story", "4 edits")
#: off (--spec-tokens 0), on (the default: drafts where they are measured to pay), and
#: always (RINGLET_TEST_SPEC_ALWAYS=1: drafts on every step a drafter can, whatever the cost)
SIDES = ("off", "on", "always")


def _spec(url: str) -> dict:
    return httpx.get(f"{url}/v1/cluster", timeout=10).json().get("speculation") or {}


def main() -> dict:
    results: dict = {}
    for stages in STAGES:
        # one cluster at a time (the machine is shared): off and on alternate, repeat by
        # repeat, so a change in what else runs on the machine tends to hit both
        runs: dict = {(case, side): [] for case in CASES for side in SIDES}
        figures: dict = {(case, side): {"trips": 0, "tokens": 0, "drafted": 0, "accepted": 0}
                         for case in CASES for side in SIDES}
        for rep in range(REPEATS):
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                args = ["--spec-tokens", "0"] if side == "off" else []
                env = {SPEC_ALWAYS_ENV: "1"} if side == "always" else None
                with LocalCluster(stages, dtype="float32", extra_args=args, env=env) as c:
                    url = c.api_urls[0]
                    asyncio.run(_case(url, "story"))  # warm up: tokenizer, first forwards
                    for case in CASES:
                        before = _spec(url)
                        runs[case, side].append(asyncio.run(_case(url, case)))
                        after = _spec(url)
                        for k in figures[case, side]:
                            figures[case, side][k] += after.get(k, 0) - before.get(k, 0)
        rows = {}
        for case in CASES:
            off = statistics.median(r["tokens_per_s"] for r in runs[case, "off"])
            row: dict = {"off_tokens_per_s": round(off, 2), "runs_off": [round(r["tokens_per_s"], 2)
                                                                          for r in runs[case, "off"]]}
            line = f"  {stages} stage(s) {case:26s} off {off:6.2f} tok/s"
            for side in SIDES[1:]:
                on = statistics.median(r["tokens_per_s"] for r in runs[case, side])
                fig = figures[case, side]
                per_trip = round(fig["tokens"] / fig["trips"], 2) if fig["trips"] else None
                acceptance = round(fig["accepted"] / fig["drafted"], 3) if fig["drafted"] else None
                row[side] = {"tokens_per_s": round(on, 2), "ratio_to_off": round(on / off, 3),
                             "tokens_per_trip": per_trip, "acceptance": acceptance, "trips": fig["trips"],
                             "runs": [round(r["tokens_per_s"], 2) for r in runs[case, side]],
                             "same_length_as_off": runs[case, side][0]["tokens"] == runs[case, "off"][0]["tokens"]}
                line += (f" | {side} {on:6.2f} tok/s ratio {on / off:4.2f} tokens/trip {per_trip} "
                         f"acceptance {acceptance} trips {fig['trips']}")
            rows[case] = row
            print(line, flush=True)
        results[f"{stages}_stages"] = rows
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1, default=str))
