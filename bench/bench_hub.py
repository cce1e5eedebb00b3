"""Hub benchmark (issue #19): what each of 3 daemons downloads of a Hub model, against the
model's total and its own share, and the time to serving of 3 empty nodes that each
download their own layers against 1 node downloading everything while the others fetch
from it.

The Hub is served on this machine (``tests/hub_server.py``, the real ``huggingface_hub``
client on the nodes' side); the model is a random llama of 12 layers of ~3.9 MB
(float32, hidden 256) written at run time, one safetensors file per layer plus one for the
embedding and one for the norm and head, with an index. Each node has its own empty
``HF_HUB_CACHE`` and its own endpoint tag, so the server's log says who fetched what.

* ``bytes``: per node, the weight bytes it downloaded whole, the bytes of the files its
  layer range needs (its share: the files of its layers, the embedding's on the first
  stage, the head's on the last), the header reads (``get_safetensors_metadata``: the
  first 100 kB of every weight file) and the small files (config, tokenizer, index).
  Goal: downloaded weights within 10 % of the share.
* ``time``: from launching the daemons to a committed plan of 3 stages. (a) 3 empty
  nodes, each downloading its own files from the Hub; (b) 1 node downloads every file
  from the Hub, then 2 nodes without the Hub (``HF_HUB_OFFLINE=1``) join and fetch their
  layers from it. Every Hub response is throttled to ``RATE`` bytes/s per request (the
  nodes download one file at a time, so that is the rate of each node's Hub link);
  the member-to-member transfer in (b) is loopback gRPC, not throttled, which favours (b).
* ``netns``: the same two timings with every node in a network namespace of its own
  (``tests/netns.py``), its link to the switch shaped with ``tc tbf`` to ``TBF_RATE``
  both ways, and the Hub in the switch's namespace, unthrottled: each node's Hub
  downloads and its member-to-member transfers share its one shaped link, as on a LAN.
  To serving: from launching the daemons to a 3-stage plan committed on every node and
  one completion answered through node 0. Needs root (skipped, and said, otherwise).

Usage: ``.venv/bin/python bench/bench_hub.py`` (writes ``bench/results_hub.json``;
``main() -> dict`` for bench/run.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results_hub.json"
TESTS = Path(__file__).resolve().parent.parent / "tests"
LAYERS = 12
RATE = 20_000_000  # bytes/s per Hub request
TBF_RATE = "40mbit"  # each node's link in the netns variant: 5 MB/s each way
REPO_ID = "bench-org/llama12"


def _model() -> dict[str, bytes]:
    sys.path.insert(0, str(TESTS))
    from tiny_models import CONFIGS, sharded_model_files

    config = {**CONFIGS["llama"], "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": LAYERS,
              "num_attention_heads": 8, "num_key_value_heads": 4}
    return sharded_model_files(config=config)


def _bytes_per_node(hub, files: dict[str, bytes], cluster) -> list[dict]:
    from tiny_models import stage_file_names

    total = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
    rows = []
    for i in range(3):
        start, end = cluster.cluster_info(i)["layer_range"]
        whole = [e for e in hub.downloads(f"n{i}") if e.file.endswith(".safetensors")]
        share = sum(len(files[f]) for f in stage_file_names(start, end, LAYERS))
        got = sum(e.sent for e in whole)
        rows.append({
            "node": i, "layers": [start, end], "weights_downloaded_bytes": got, "share_bytes": share,
            "downloaded_over_share": got / share, "share_of_model": share / total, "model_bytes": total,
            "header_read_bytes": sum(e.sent for e in hub.requests(f"n{i}", "GET")
                                     if e.file.endswith(".safetensors") and e.range),
            "small_file_bytes": sum(e.sent for e in hub.downloads(f"n{i}") if not e.file.endswith(".safetensors")),
        })
    return rows


def _netns_to_serving(files: dict[str, bytes], every_node_from_hub: bool) -> dict:
    """Seconds from launching 3 namespaced daemons to a committed 3-stage plan and one
    answered completion; with ``every_node_from_hub`` false, node 0 alone reaches the Hub
    and nodes 1 and 2 (``HF_HUB_OFFLINE=1``) start once it serves, fetching from it.
    Also the weight bytes each node downloaded from the Hub."""
    from hub_server import FakeHub, node_env
    from netns import HUB_IP, NetnsLab

    with tempfile.TemporaryDirectory() as tmp_dir, NetnsLab() as lab:
        nodes = [lab.add_node(["--model", REPO_ID]) for _ in range(3)]
        for i in range(3):
            lab.shape(i, rate=TBF_RATE)
        hub = FakeHub(host=HUB_IP)
        lab.call(hub.__enter__)  # its socket opened inside the switch's namespace
        try:
            hub.add_commit(REPO_ID, files)
            for i, d in enumerate(nodes):
                offline = {} if every_node_from_hub or i == 0 else {"HF_HUB_OFFLINE": "1"}
                d.env = node_env(hub, Path(tmp_dir), i, **offline)
            t0 = time.monotonic()
            if every_node_from_hub:
                lab.start_nodes(nodes, timeout_s=300)
            else:
                lab.start_nodes(nodes[:1], timeout_s=300)
                lab.wait_converged(nodes[:1], stages=1, timeout_s=600)
                lab.start_nodes(nodes[1:], timeout_s=300)
            lab.wait_converged(nodes, stages=3, timeout_s=600)
            r = lab.post(nodes[0], "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
            if r.status_code != 200:
                raise RuntimeError(f"the cluster did not answer: {r.status_code} {r.text[:300]}")
            seconds = time.monotonic() - t0
            got = [sum(e.sent for e in hub.downloads(f"n{i}") if e.file.endswith(".safetensors")) for i in range(3)]
        finally:
            hub.__exit__(None, None, None)
    return {"seconds": seconds, "hub_weight_bytes_per_node": got}


def netns_times(files: dict[str, bytes]) -> dict:
    """The ``netns`` figures of the module docstring, or why they were skipped."""
    from netns import cleanup_stale, skip_reason

    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    cleanup_stale()
    each = _netns_to_serving(files, every_node_from_hub=True)
    one = _netns_to_serving(files, every_node_from_hub=False)
    return {"tbf_rate": TBF_RATE, "three_from_hub": each, "one_from_hub_two_from_it": one,
            "ratio": one["seconds"] / each["seconds"]}


def main() -> dict:
    sys.path.insert(0, str(TESTS))
    from hub_server import FakeHub, node_env

    from ringlet.daemon.ops.demo import LocalCluster

    files = _model()
    out: dict = {"layers": LAYERS, "rate_bytes_per_s": RATE,
                 "model_weight_bytes": sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with FakeHub() as hub:
            hub.add_commit("bench-org/llama12", files)
            hub.rate_bytes_per_s = RATE
            t0 = time.monotonic()
            with LocalCluster(3, model="bench-org/llama12", dynamic=True,
                              per_node_env=[node_env(hub, tmp / "a", i) for i in range(3)]) as c:
                c.wait_plan(stages=3, timeout_s=300)
                out["time_3_from_hub_s"] = time.monotonic() - t0
                out["bytes"] = _bytes_per_node(hub, files, c)
        with FakeHub() as hub:
            hub.add_commit("bench-org/llama12", files)
            hub.rate_bytes_per_s = RATE
            t0 = time.monotonic()
            with LocalCluster(1, model="bench-org/llama12", dynamic=True,
                              per_node_env=[node_env(hub, tmp / "b", 0)]) as c:
                c.wait_plan(stages=1, timeout_s=300)
                out["time_1_from_hub_s"] = time.monotonic() - t0
                for i in (1, 2):
                    c.add_node(env=node_env(hub, tmp / "b", i, HF_HUB_OFFLINE="1"), wait=False)
                c.wait_plan(stages=3, timeout_s=300)
                out["time_1_from_hub_then_2_from_it_s"] = time.monotonic() - t0
    out["time_ratio"] = out["time_1_from_hub_then_2_from_it_s"] / out["time_3_from_hub_s"]
    out["netns"] = netns_times(files)
    RESULTS.write_text(json.dumps(out, indent=1))
    for row in out["bytes"]:
        print(f"node {row['node']} layers {row['layers']}: {row['weights_downloaded_bytes'] / 1e6:.1f} MB of weights "
              f"= {row['downloaded_over_share']:.3f} x its share ({row['share_of_model']:.1%} of "
              f"{row['model_bytes'] / 1e6:.1f} MB); header reads {row['header_read_bytes'] / 1e6:.2f} MB, small files "
              f"{row['small_file_bytes'] / 1e3:.1f} kB")
    print(f"to serving: 3 nodes from the Hub {out['time_3_from_hub_s']:.1f} s; 1 from the Hub, 2 from it "
          f"{out['time_1_from_hub_then_2_from_it_s']:.1f} s ({out['time_ratio']:.2f}x)")
    ns = out["netns"]
    if "skipped" in ns:
        print(f"netns variant skipped: {ns['skipped']}")
    else:
        print(f"netns, every link tbf {ns['tbf_rate']}: 3 nodes from the Hub {ns['three_from_hub']['seconds']:.1f} s "
              f"(Hub bytes per node {[round(b / 1e6, 1) for b in ns['three_from_hub']['hub_weight_bytes_per_node']]}"
              f" MB); 1 from the Hub, 2 from it {ns['one_from_hub_two_from_it']['seconds']:.1f} s "
              f"({ns['ratio']:.2f}x)")
    return out


if __name__ == "__main__":
    from ringlet.daemon.probes import blas

    blas.load()
    main()
