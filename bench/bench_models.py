"""Several models on one cluster (#45): each model's decode tokens/s alone and with the
other model busy, side by side in one run, on a 2-node ring serving both (the bundled
SmolLM2-135M in float32, priority 1, and a random ~720 MB llama, priority 2); and the
bundled model on a plain single-model 2-node ring in the same run (what the node's front
and the second lane cost when the second model is idle).

Definitions: one greedy streamed ``/v1/completions`` of ``TOKENS`` tokens to node 0;
decode tokens/s = (tokens - 1) / (last token's arrival - first token's arrival); the
figure is the median of ``RUNS``. "Busy": another client streams the other model's
completions through node 1 without a pause during the measurement. Ratios only: the
machine has 2 cores for 4 lane processes (plus the fronts), so the busy figures measure
sharing those cores as much as anything; on Macs each lane runs on its own GPU time.

Run: ``python bench/run.py bench_models`` or ``python bench/bench_models.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from tiny_models import CONFIGS, make_chat_model  # noqa: E402 - the paths are set just above

from ringlet.daemon.ops.demo import LocalCluster  # noqa: E402

TOKENS = 48
RUNS = 3
LARGER = {**CONFIGS["llama"], "vocab_size": 98, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
          "max_position_embeddings": 2048}
PROMPTS = {"smollm2-135m": "Once upon a time", "larger-llama": "abcdefg"}


def decode_rate(url: str, model: str) -> float:
    """One streamed completion's decode tokens/s."""
    arrivals: list[float] = []
    body = {"model": model, "prompt": PROMPTS[model], "max_tokens": TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"{model}: {len(arrivals)} token(s) streamed")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def median_rate(url: str, model: str) -> float:
    return statistics.median(decode_rate(url, model) for _ in range(RUNS))


def busy(url: str, model: str, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            try:
                decode_rate(url, model)
            except Exception:  # noqa: BLE001 - a busy client only keeps the model busy
                time.sleep(0.2)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def wait_serving(c: LocalCluster, keys: set[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = [c.cluster_info(i) for i in (0, 1)]
        if all({m["key"] for m in v.get("models", []) if m["state"] == "serving"} >= keys for v in views):
            return
        time.sleep(0.5)
    raise RuntimeError("the models did not serve in time")


def main() -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        larger = make_chat_model("llama", Path(tmp) / "larger-llama", LARGER)
        with LocalCluster(2, dtype="float32", dynamic=True) as plain:
            plain.wait_plan(stages=2)
            out["plain_single_model"] = median_rate(plain.api_urls[0], "smollm2-135m")
        args = ["--model", "smollm2-135m", "--model", str(larger), "--context", "2048"]
        with LocalCluster(2, dtype="float32", dynamic=True, extra_args=args) as c:
            wait_serving(c, set(PROMPTS))
            for model, other in (("smollm2-135m", "larger-llama"), ("larger-llama", "smollm2-135m")):
                alone = median_rate(c.api_urls[0], model)
                stop = threading.Event()
                t = busy(c.api_urls[1], other, stop)
                time.sleep(1.0)
                with_other = median_rate(c.api_urls[0], model)
                stop.set()
                t.join(300)
                out[model] = {"alone_tokens_per_s": round(alone, 1), "other_busy_tokens_per_s": round(with_other, 1),
                              "busy_over_alone": round(with_other / alone, 3)}
                print(f"   {model}: alone {alone:.1f} tokens/s, with {other} busy {with_other:.1f} tokens/s "
                      f"({with_other / alone:.2f}x)")
    out["two_models_over_plain"] = round(out["smollm2-135m"]["alone_tokens_per_s"] / out["plain_single_model"], 3)
    print(f"   smollm2-135m alone on the 2-model ring / on a plain ring: {out['two_models_over_plain']:.2f}x "
          f"({out['plain_single_model']:.1f} tokens/s plain)")
    Path(__file__).with_name("results_models.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    from ringlet.daemon.probes import blas

    blas.load()
    main()
