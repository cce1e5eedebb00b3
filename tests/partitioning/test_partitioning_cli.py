"""``ringlet plan``: plan output, JSON, unit parsing, and one-line errors with exit code 2."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet.daemon.ops import plan as plan_cli
from ringlet.partitioning import Plan, validate_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def files(tmp_path):
    nodes = {
        "nodes": [
            {"node_id": "a", "memory": "1 MiB", "bandwidth": "100 GB/s", "flops": "1 TFLOPS"},
            {"node_id": "b", "memory_bytes": 1048576, "bandwidth_bytes_per_s": 1e11, "flops": 1e12},
        ],
        "links": [{"a": "a", "b": "b", "bandwidth": "80 Gb/s", "latency": "50 us", "kind": "tb5"}],
        "policy": {"fallback_bandwidth": "10 Gb/s", "fallback_latency": "200 us"},
    }
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def run(*argv):
    return plan_cli.main([str(a) for a in argv])


def test_json_output_is_a_valid_plan(files, capsys):
    assert run("--nodes", files / "nodes.json", "--model", files / "m", "--context", 64, "--json") == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    validate_plan(plan, 6)
    assert plan.model_name == "m" and plan.context_tokens == 64
    assert plan.hops[0].kind == "direct"


def test_table_output(files, capsys):
    assert run("--nodes", files / "nodes.json", "--model", files / "m", "--policy", "memory") == 0
    out = capsys.readouterr().out
    assert "ringlet plan" in out and "policy memory" in out and "plan id" in out


def test_previous_plan_round_trip(files, capsys):
    run("--nodes", files / "nodes.json", "--model", files / "m", "--json")
    (files / "prev.json").write_text(capsys.readouterr().out)
    assert run("--nodes", files / "nodes.json", "--model", files / "m", "--previous", files / "prev.json",
               "--json") == 0
    assert json.loads(capsys.readouterr().out)["load_bytes"] == 0


def test_inline_json_model(files, capsys):
    assert run("--nodes", files / "nodes.json", "--model", json.dumps(TINY), "--json") == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_layers"] == 6


def _bad(capsys, *argv):
    code = run(*argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringlet plan: error:"), err
    assert "Traceback" not in err
    return lines[0]


def test_missing_nodes_file(files, capsys):
    assert "no such nodes file" in _bad(capsys, "--nodes", files / "nope.json", "--model", files / "m")


def test_bad_units(files, capsys):
    data = json.loads((files / "nodes.json").read_text())
    data["nodes"][0]["memory"] = "lots"
    (files / "bad.json").write_text(json.dumps(data))
    assert "nodes[0].memory" in _bad(capsys, "--nodes", files / "bad.json", "--model", files / "m")


def test_nan_memory_names_the_field(files, capsys):
    text = (files / "nodes.json").read_text().replace("1048576", "NaN")
    (files / "nan.json").write_text(text)
    assert "memory_bytes" in _bad(capsys, "--nodes", files / "nan.json", "--model", files / "m")


def test_duplicate_ids(files, capsys):
    data = json.loads((files / "nodes.json").read_text())
    data["nodes"][1]["node_id"] = "a"
    (files / "dup.json").write_text(json.dumps(data))
    assert "duplicate node_id 'a'" in _bad(capsys, "--nodes", files / "dup.json", "--model", files / "m")


def test_bad_model(files, capsys):
    (files / "x").mkdir()
    (files / "x" / "config.json").write_text(json.dumps({"model_type": "nonexistent_arch"}))
    assert "--model" in _bad(capsys, "--nodes", files / "nodes.json", "--model", files / "x")
    assert "no such config" in _bad(capsys, "--nodes", files / "nodes.json", "--model", files / "missing")


def test_bad_previous(files, capsys):
    (files / "prev.json").write_text('{"format": 1}')
    assert "--previous" in _bad(capsys, "--nodes", files / "nodes.json", "--model", files / "m",
                                "--previous", files / "prev.json")


def test_infeasible_exits_1_with_the_shortfall(files, capsys):
    data = json.loads((files / "nodes.json").read_text())
    for n in data["nodes"]:
        n.pop("memory", None)
        n["memory_bytes"] = 1000
    (files / "small.json").write_text(json.dumps(data))
    code = run("--nodes", files / "small.json", "--model", files / "m", "--json")
    out, err = capsys.readouterr()
    assert code == 1
    assert json.loads(out)["error"] == "infeasible" and json.loads(out)["shortfall_bytes"] > 0
    assert "does not fit" in err and "Traceback" not in err


def test_add_plan_parser_registers_the_subcommand(files):
    parser = argparse.ArgumentParser(prog="ringlet")
    sub = parser.add_subparsers(dest="command")
    plan_cli.add_plan_parser(sub)
    args = parser.parse_args(["plan", "--nodes", str(files / "nodes.json"), "--model", str(files / "m")])
    assert args.command == "plan" and args.func is plan_cli.run_plan


@pytest.mark.parametrize(
    ("text", "parse", "value"),
    [
        ("480 GiB", plan_cli.parse_bytes, 480 * 2**30),
        ("512GB", plan_cli.parse_bytes, 512e9),
        ("819 GB/s", plan_cli.parse_bandwidth, 819e9),
        ("80 Gb/s", plan_cli.parse_bandwidth, 10e9),
        ("10 Gbit/s", plan_cli.parse_bandwidth, 1.25e9),
        ("50 us", plan_cli.parse_seconds, 5e-5),
        ("1 ms", plan_cli.parse_seconds, 1e-3),
        ("28.4 TFLOPS", plan_cli.parse_flops, 28.4e12),
        (7, plan_cli.parse_bytes, 7),
    ],
)
def test_units(text, parse, value):
    assert parse(text, "x") == pytest.approx(value)


def test_seed_cluster_example_plans_all_three_models():
    for model in ("deepseek-v3-671b-8bit", "kimi-k2-1t-4bit", "qwen3-235b-a22b-8bit"):
        code = plan_cli.main(["--nodes", str(EXAMPLES / "seed_cluster.json"),
                              "--model", str(EXAMPLES / "models" / model), "--context", "32768", "--json"])
        assert code == 0


def test_module_entry_point_has_no_traceback(files):
    proc = subprocess.run(
        [sys.executable, "-m", "ringlet.daemon.ops.plan", "--nodes", str(files / "nope.json"), "--model", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("ringlet plan: error:") and "Traceback" not in proc.stderr


def test_several_models_on_the_seed_cluster():
    models = EXAMPLES / "models"
    code = plan_cli.main(["--nodes", str(EXAMPLES / "seed_cluster.json"), "--context", "32768", "--json",
                          "--model", str(models / "deepseek-v3-671b-4bit"),
                          "--model", str(models / "qwen3-235b-a22b-4bit"),
                          "--model", str(models / "llama-3.2-3b-4bit")])
    assert code == 0


def test_two_models_json_placement(files, capsys):
    assert run("--nodes", files / "nodes.json", "--model", files / "m", "--model", json.dumps(TINY),
               "--name", "first", "--name", "second", "--context", 64, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["priority"] == ["first", "second"] and data["left_out"] == {}
    used = {n: 0 for n in data["memory_bytes"]}
    for name, plan in data["plans"].items():
        validate_plan(Plan.from_dict(plan), 6)
        assert plan["model"]["name"] == name
        for s in plan["stages"]:
            used[s["node_id"]] += s["memory_bytes"]
    assert all(data["memory_left"][n] == data["memory_bytes"][n] - used[n] >= 0 for n in used)


def test_two_models_table_and_previous(files, capsys):
    argv = ["--nodes", files / "nodes.json", "--model", files / "m", "--model", json.dumps(TINY),
            "--name", "first", "--name", "second"]
    assert run(*argv, "--json") == 0
    (files / "placement.json").write_text(capsys.readouterr().out)
    assert run(*argv, "--previous", files / "placement.json") == 0
    out = capsys.readouterr().out
    assert "2 models in pooled memory" in out and "priority 1 of 2 · first" in out
    assert "priority 2 of 2 · second" in out and "memory per node" in out
    assert out.count("load 0 B") == 2


def test_a_second_model_that_does_not_fit_is_left_out(files, capsys):
    # TINY at 512 tokens: a layer is 74 kB of bfloat16 weights + 66 kB of KV, the tied
    # embedding 33 kB on both end stages. The first copy takes 3 + 3 layers: 451 kB + 100 KiB
    # of overhead on each 1 MiB node, leaving 495 kB; the second is offered 392 kB a node,
    # room for 2 layers (312 kB) but not 3 (451 kB): 4 of its 6 layers, so it is left out.
    code = run("--nodes", files / "nodes.json", "--model", files / "m", "--model", files / "m",
               "--name", "first", "--name", "second", "--model-overhead", "100 KiB", "--json")
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 1 and list(data["plans"]) == ["first"] and list(data["left_out"]) == ["second"]
    assert "left out: model 'second' does not fit beside 'first'" in err


def test_several_models_bad_names(files, capsys):
    assert "one --name per --model" in _bad(capsys, "--nodes", files / "nodes.json", "--model", files / "m",
                                            "--model", files / "m", "--name", "x")
    assert "same name" in _bad(capsys, "--nodes", files / "nodes.json", "--model", files / "m",
                               "--model", files / "m")


def test_one_models_context_changes_its_kv_alone(capsys):
    """``--model-context`` plans one model's KV at its own context; the others keep theirs.
    DeepSeek V3 caches MLA's compressed latent: (kv_lora_rank 512 + qk_rope_head_dim 64)
    bf16 values, 2 bytes each, per token and layer, over 61 layers (its config.json). Going
    from its full 163,840 tokens to 32,768 frees (163,840 - 32,768) x 61 x 576 x 2 bytes,
    worked out by hand: 9,210,691,584 bytes over the cluster."""
    models = EXAMPLES / "models"
    argv = ["--nodes", str(EXAMPLES / "seed_cluster.json"), "--json",
            "--model", str(models / "deepseek-v3-671b-4bit"), "--model", str(models / "llama-3.2-3b-4bit")]

    def placed(*more: str) -> dict:
        assert plan_cli.main([*argv, *more]) == 0
        return json.loads(capsys.readouterr().out)

    full, short = placed(), placed("--model-context", "deepseek-v3-671b-4bit=32768")
    assert short["plans"]["deepseek-v3-671b-4bit"]["model"]["context_tokens"] == 32768
    assert full["plans"]["deepseek-v3-671b-4bit"]["model"]["context_tokens"] == 163840
    def llama(placement: dict) -> tuple:  # its context, ranges and memory (its capacity is what deepseek leaves)
        plan = placement["plans"]["llama-3.2-3b-4bit"]
        return plan["model"], [(s["node_id"], s["start"], s["end"], s["memory_bytes"]) for s in plan["stages"]]

    assert llama(short) == llama(full)
    assert sum(short["memory_left"].values()) - sum(full["memory_left"].values()) == 9_210_691_584
    assert "'gpt-4' is not one of the --model values" in _bad(capsys, *argv, "--model-context", "gpt-4=8192")
    assert "not a positive number of tokens" in _bad(capsys, *argv, "--model-context", "llama-3.2-3b-4bit=0")
