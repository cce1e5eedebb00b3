"""Speculative decoding in a tensor group (issue #34): decode tokens/s with rank 0's drafts
on (where measured to pay), always (every step the drafter can) and off, in the same run,
on the default model (SmolLM2-135M-Instruct, float32) in a group of 1 rank (rank 0's own
loop, no collective) and of 3 ranks (its heads allow 3; more ranks than this box's 2 cores:
the poll shim of tests/tp_support.py, so the figures include the contention).

Cases: ``bench_spec``'s edit (a ~600-token Python file, "rename x to y and return the
whole file": drafts from prompt lookup), the same edit with the original file as the
prediction, and both with the answer prefilled with a code fence (the prompt ends inside
the assistant's turn), with which this model writes the file out. Decode tokens/s =
(tokens - 1) / (last token's arrival - first token's), at the supervisor; median of
``REPEATS``, off / on / always alternating. Ratios are the result.

Run: ``python bench/run.py bench_spec_tensor``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from bench_spec import EDIT_TOKENS, FENCE, edit_message

from ringlet.daemon.engine.model_info import load_tokenizer
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.tensor.group import TPGroup

RANKS = (1, 3)
REPEATS = 2
SIDES = ("off", "on", "always")


async def _decode(group: TPGroup, prompt: list[int], prediction: list[int] | None, side: str,
                  stop: list[int]) -> dict:
    info: dict = {}
    spec = None if side == "off" else {"k": 6, "prediction": prediction or [], "measured": side == "on"}
    times: list[float] = []
    async for _ in group.generate(prompt, EDIT_TOKENS, stop_ids=stop, info=info, spec=spec):
        times.append(time.perf_counter())
    accepted, rejected, trips = info.get("drafts", (0, 0, 0))
    return {"tokens_per_s": (len(times) - 1) / (times[-1] - times[0]), "tokens": len(times),
            "accepted": accepted, "drafted": accepted + rejected, "trips": trips}


async def _ranks(ranks: int, cases: dict[str, tuple[list[int], list[int] | None]], stop: list[int]) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tp_support import rank_env

    group = TPGroup.local(None, ranks, dtype="float32", extra_env=rank_env(ranks),
                          mode=None if ranks == 1 else "tensor", step_timeout=300)
    await group.start()
    try:
        await _decode(group, cases["edit"][0], None, "off", stop)  # warm up
        runs: dict = {(case, side): [] for case in cases for side in SIDES}
        for rep in range(REPEATS):
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                for case, (prompt, prediction) in cases.items():
                    runs[case, side].append(await _decode(group, prompt, prediction, side, stop))
    finally:
        await group.close()
    rows = {}
    for case in cases:
        off = statistics.median(r["tokens_per_s"] for r in runs[case, "off"])
        row: dict = {"off_tokens_per_s": round(off, 2)}
        line = f"  {ranks} rank(s) {case:26s} off {off:6.2f} tok/s"
        for side in SIDES[1:]:
            on = statistics.median(r["tokens_per_s"] for r in runs[case, side])
            drafted = sum(r["drafted"] for r in runs[case, side])
            trips = sum(r["trips"] for r in runs[case, side])
            accepted = sum(r["accepted"] for r in runs[case, side])
            acceptance = round(accepted / drafted, 3) if drafted else None
            per_trip = round((accepted + trips) / trips, 2) if trips else None
            row[side] = {"tokens_per_s": round(on, 2), "ratio_to_off": round(on / off, 3), "acceptance": acceptance,
                         "tokens_per_trip": per_trip, "trips": trips,
                         "same_tokens_as_off": runs[case, side][0]["tokens"] == runs[case, "off"][0]["tokens"]}
            line += f" | {side} {on:6.2f} ratio {on / off:4.2f} acceptance {acceptance} tokens/trip {per_trip}"
        print(line, flush=True)
        rows[case] = row
    return rows


def main() -> dict:
    tokenizer = load_tokenizer(resolve(None))
    message, original = edit_message(1)
    asked = [{"role": "user", "content": message}]
    prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True)
    prefilled = tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": FENCE}],
                                              continue_final_message=True, add_generation_prompt=False)
    cases = {"edit": (prompt, None),
             "edit+prediction": (prompt, tokenizer.encode(original, add_special_tokens=False)),
             "edit, prefilled": (prefilled, None),
             "edit+prediction, prefilled": (prefilled, tokenizer.encode(original[len(FENCE):],
                                                                        add_special_tokens=False))}
    stop = sorted(tokenizer.eos_token_ids)
    return {f"{ranks}_ranks": asyncio.run(_ranks(ranks, cases, stop)) for ranks in RANKS}
