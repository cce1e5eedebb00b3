"""Prefill benchmark (issue #8, chunked prefill): what a long prompt costs the requests
already decoding, and its own TTFT, with prompts prefilled in chunks vs in one piece.

Two local daemons (2 stages, default model) per setting, measured in the same run:

* ``--prefill-chunk 64``: stage 0 sends each 64-token chunk on as soon as it is
  computed; the decode steps of other requests run between chunks.
* ``--prefill-chunk 65536``: the whole prompt in one forward per stage (unchunked).

The prefix cache is off (``--prefix-cache-bytes 0``): B's prompt is the same in every
run, and a hit would measure no prefill at all.

One request A streams ``TOKENS`` greedy tokens; after its 8th token a request B with
a prompt of ~``LONG`` tokens arrives (4 tokens out). Reported per setting, medians of
``RUNS``: A's longest gap between two tokens while B prefills (s), A's median gap
(the undisturbed decode step, s), and B's TTFT (s). The ratios chunked / unchunked
are the figures to read.

Run: ``python bench/run.py bench_prefill`` or ``python bench/bench_prefill.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from bench_blas import BEFORE_ISSUE_15
from bench_spine import stream_times

from ringlet.daemon.ops.demo import LocalCluster

TOKENS = 40
LONG = 300
RUNS = 3
CHUNKS = (64, 65536)
PROMPT_A = "Once upon a time"
# ~10 tokens per sentence: a long, plain prompt of about LONG tokens
PROMPT_B = " ".join(["The quick brown fox jumps over the lazy dog."] * (LONG // 10)) + " Summarise:"


def one_run(url: str) -> dict:
    a_times: list[float] = []
    b_times: list[float] = []
    go = threading.Event()
    errors: list[str] = []

    def eighth_token(n: int) -> None:
        if n >= 8:
            go.set()

    def run_a() -> None:
        try:
            stream_times(url, PROMPT_A, TOKENS, a_times, on_token=eighth_token)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.append(str(exc))
            go.set()

    a = threading.Thread(target=run_a)
    a.start()
    go.wait(300)
    t_send = time.perf_counter()
    stream_times(url, PROMPT_B, 4, b_times)
    a.join()
    gaps = [y - x for x, y in zip(a_times, a_times[1:], strict=False)]
    during = [y - x for x, y in zip(a_times, a_times[1:], strict=False) if y > t_send and x < b_times[0]]
    if errors or len(a_times) < TOKENS:
        raise RuntimeError(f"request A failed while B prefilled: {errors or len(a_times)}")
    return {"a_max_gap_s": max(during or gaps), "a_median_gap_s": statistics.median(gaps),
            "b_ttft_s": b_times[0] - t_send}


def measure(chunk: int, before_15: bool = False) -> dict:
    """A's gaps and B's TTFT on 2 daemons with ``--prefill-chunk chunk`` (seconds, medians of
    ``RUNS``); ``before_15``: with the node settings before issue #15 (measured beside the
    default in the same run, chunked only)."""
    env, dtype = BEFORE_ISSUE_15 if before_15 else ({}, None)
    # the prefix cache off: B's prompt is the same in every run, and a hit would skip its prefill
    args = ["--prefill-chunk", str(chunk), "--prefix-cache-bytes", "0"]
    with LocalCluster(2, extra_args=args, env=env, dtype=dtype) as c:
        url = c.api_urls[0]
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "prompt": PROMPT_B, "max_tokens": 1, "return_token_ids": True})
        if r.status_code != 200:
            raise RuntimeError(f"the long prompt was refused: {r.status_code} {r.text[:300]}")
        prompt_tokens = r.json()["choices"][0]["prompt_token_ids"]
        runs = [one_run(url) for _ in range(RUNS)]
    return {"prefill_chunk": chunk, "before_issue_15": before_15, "prompt_tokens": len(prompt_tokens),
            **{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "runs": runs}


def main() -> dict:
    results = [measure(c) for c in CHUNKS]
    chunked, whole = results
    before = measure(CHUNKS[0], before_15=True)
    ratios = {k: chunked[k] / whole[k] for k in ("a_max_gap_s", "a_median_gap_s", "b_ttft_s")}
    print(f"2 daemons; request A decoding {TOKENS} tokens; request B with a {chunked['prompt_tokens']}-token prompt "
          f"arrives after A's 8th token; medians of {RUNS}")
    print(f"{'prefill chunk':>14}{'A longest gap s':>17}{'A median gap s':>16}{'B TTFT s':>10}")
    for r in results:
        print(f"{r['prefill_chunk']:>14}{r['a_max_gap_s']:>17.3f}{r['a_median_gap_s']:>16.3f}{r['b_ttft_s']:>10.3f}")
    print(f"{'ratio':>14}{ratios['a_max_gap_s']:>17.3f}{ratios['a_median_gap_s']:>16.3f}{ratios['b_ttft_s']:>10.3f}")
    print(f"{before['prefill_chunk']:>14}{before['a_max_gap_s']:>17.3f}{before['a_median_gap_s']:>16.3f}"
          f"{before['b_ttft_s']:>10.3f}  reference BLAS, Q4 (before issue #15)")
    speedup = {k: before[k] / chunked[k] for k in ("a_max_gap_s", "a_median_gap_s", "b_ttft_s")}
    print(f"{'before / now':>14}{speedup['a_max_gap_s']:>17.2f}{speedup['a_median_gap_s']:>16.2f}"
          f"{speedup['b_ttft_s']:>10.2f}  (chunk {CHUNKS[0]})")
    out = {"bench": "prefill", "tokens": TOKENS, "runs": RUNS, "results": results, "ratio_chunked_to_whole": ratios,
           "before_issue_15": before, "before_over_now": speedup}
    Path(__file__).with_name("results_prefill.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
