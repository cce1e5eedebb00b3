"""KV migration benchmark: the longest gap between streamed tokens when the ring changes
under a long request, with KV moving with its layers (``--kv-migration on``) and with
the old re-prefill (``off``), side by side in one run.

Events: a join (2 -> 3 daemons), a ``SIGTERM``ed leave of the middle stage (3 -> 2) and
a kill -9 of the middle stage, at contexts of about 500, 2,000 and 4,000 prompt tokens
(``RINGLET_BENCH_CONTEXTS`` to change). Real ``ringlet run`` daemons on 127.0.0.1,
float32, the bundled model. Reported per case: the longest gap (s), tokens prefilled
again on the new plan, tokens rebuilt from boundary activations (weighted by the share
of layers rebuilt), KV bytes moved, and the ratio off / on of the gaps. For kill -9,
"on" rebuilds the lost layers from the states the previous stage kept, "off" prefills
every request again; the issue's goal there is a gap of at most lost / total layers of
the re-prefill gap, plus the detection (``--remove-after-s``, 2 s by default).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from ringlet.daemon.ops.demo import LocalCluster

CONTEXTS = [int(x) for x in os.environ.get("RINGLET_BENCH_CONTEXTS", "500,2000,4000").split(",")]
EVENTS = ("join", "leave", "kill")
#: a sentence of the prompt (about 12 tokens), repeated to the context length
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
TOKENS = 64


class Stream(threading.Thread):
    """One streamed completion; keeps the arrival time of every token."""

    def __init__(self, url: str, prompt: str):
        super().__init__(daemon=True)
        self.url, self.prompt, self.times, self.error = url, prompt, [], None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if "error" in json.loads(line[6:]):
                            self.error = line
                        self.times.append(time.monotonic())
        except httpx.HTTPError as exc:
            self.error = str(exc)

    def wait_tokens(self, n: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.times) < n and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def max_gap_after(self, n: int) -> float:
        gaps = [b - a for a, b in zip(self.times[n - 1:], self.times[n:], strict=False)]
        return max(gaps, default=float("nan"))


def figures(cluster: LocalCluster) -> dict:
    infos = [cluster.cluster_info(i) for i in cluster.alive()]
    migration = [i["kv_migration"] for i in infos]
    return {"reprefilled_tokens": sum(m["reprefilled_tokens"] for m in migration),
            "full_reprefills": sum(m["full_reprefills"] for m in migration),
            "rebuilt_tokens": sum(m.get("rebuilt_tokens", 0) for m in migration),
            "kv_bytes_moved": sum(m["kv_bytes_received"] + m.get("precopied_bytes", 0) for m in migration),
            "kv_bytes_at_commit": sum(m["kv_bytes_received"] for m in migration)}


def one(event: str, context: int, mode: str) -> dict:
    prompt = SENTENCE * max(1, context // 12)
    n = 2 if event == "join" else 3
    with LocalCluster(n, dynamic=True, dtype="float32", extra_args=["--kv-migration", mode]) as c:
        plan = c.wait_plan(stages=n, timeout_s=120)
        api, lost = 0, 0
        if event != "join":
            middle = next(i for i in c.alive() if c.cluster_info(i)["node_id"] == plan["plan"][1]["node_id"])
            api = next(i for i in c.alive() if i != middle)
            lost = plan["plan"][1]["end"] - plan["plan"][1]["start"]
        stream = Stream(c.api_urls[api], prompt)
        stream.start()
        stream.wait_tokens(8)
        if event == "join":
            c.add_node(wait=False)
        else:
            c.kill(middle, signal.SIGTERM if event == "leave" else signal.SIGKILL)
        stream.join(900)
        out = {"event": event, "context_tokens": context, "kv_migration": mode, "tokens": len(stream.times),
               "lost_layers": lost, "max_gap_s": round(stream.max_gap_after(8), 3), "error": stream.error,
               **figures(c)}
    print(f"{event:<6} ctx {context:>5} migration {mode:<3}: longest gap {out['max_gap_s']:7.2f} s, "
          f"re-prefilled {out['reprefilled_tokens']:>5} tokens, rebuilt {out['rebuilt_tokens']:>5}, "
          f"KV moved {out['kv_bytes_moved'] / 1e6:6.1f} MB ({out['kv_bytes_at_commit'] / 1e6:.1f} at the commit)"
          + (f"  ERROR {out['error']}" if out["error"] else ""))
    return out


def main() -> dict:
    rows = [one(event, ctx, mode) for event in EVENTS for ctx in CONTEXTS for mode in ("on", "off")]
    ratios = {}
    for event in EVENTS:
        for ctx in CONTEXTS:
            on = next(r for r in rows if (r["event"], r["context_tokens"], r["kv_migration"]) == (event, ctx, "on"))
            off = next(r for r in rows if (r["event"], r["context_tokens"], r["kv_migration"]) == (event, ctx, "off"))
            ratios[f"{event}_{ctx}_gap_off_over_on"] = round(off["max_gap_s"] / on["max_gap_s"], 2)
            if event == "kill":  # the goal: lost/total of the re-prefill gap, plus the 2 s detection
                ratios[f"kill_{ctx}_goal_s"] = round(on["lost_layers"] / 30 * off["max_gap_s"] + 2.0, 2)
    for k, v in ratios.items():
        print(f"{k:<32} {f'{v} s' if k.endswith('_s') else f'x{v}'}")
    out = {"bench": "migration", "rows": rows, "ratios": ratios}
    Path(__file__).with_name("results_migration.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
