"""A model's lane's command line (daemon/ops/lane_args.py) and --model-alias parsing
(daemon/ops/lanes_run.py): expected values written by hand."""

from __future__ import annotations

import sys

import pytest

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.lane_args import lane_argv, lane_key, strip_options
from ringlet.daemon.ops.lanes_run import parse_aliases, parse_model_contexts


def test_lane_keys_are_the_same_on_every_machine():
    assert lane_key("smollm2-135m") == "smollm2-135m"
    assert lane_key("/srv/models/Qwen3-4B/") == "Qwen3-4B"
    assert lane_key("/srv/models/llama.Q4_K_M.gguf") == "llama.Q4_K_M"
    assert lane_key("mlx-community/Qwen3-4B-4bit@0123abcd") == "mlx-community--Qwen3-4B-4bit"
    assert lane_key("mlx-community/Qwen3-4B-4bit") == "mlx-community--Qwen3-4B-4bit"


def test_strip_options_takes_both_spellings_and_flags():
    argv = ["-v", "run", "--model", "a", "--model=b", "--port", "1", "--secret-file", "s", "--no-dashboard",
            "--memory-limit", "8GB"]
    assert strip_options(argv, ("--model", "--port"), ("--no-dashboard",)) == [
        "-v", "run", "--secret-file", "s", "--memory-limit", "8GB"]


def test_a_lanes_command_keeps_the_nodes_options_and_sets_its_own(tmp_path):
    argv = ["run", "--model", "big", "--model", "small", "--model-alias", "h=small", "--port", "9000",
            "--api-port", "8000", "--api-host", "0.0.0.0", "--cluster", "lab", "--secret-file", "/s",
            "--data-dir", "/d"]
    cmd = lane_argv(argv, model="small", grpc_port=9001, api_port=41000, data_dir=tmp_path / "small",
                    cluster="lab/small", share_file=tmp_path / "share", supervisor_url="http://127.0.0.1:8000",
                    public_api_url="http://10.0.0.2:8000")
    assert cmd[:3] == [sys.executable, "-m", "ringlet.daemon.ops.cli"]
    assert cmd[3:] == ["run", "--secret-file", "/s", "--model", "small", "--port", "9001", "--api-host",
                       "127.0.0.1", "--api-port", "41000", "--data-dir", str(tmp_path / "small"), "--cluster",
                       "lab/small", "--no-dashboard", "--lane-supervisor", "http://127.0.0.1:8000",
                       "--public-api-url", "http://10.0.0.2:8000", "--lane-share-file", str(tmp_path / "share")]


def test_a_lanes_peers_are_the_peers_lanes_of_the_same_priority(tmp_path):
    argv = ["run", "--model", "a", "--model", "b", "--peers", "10.0.0.2:7100,[fe80::1%en0]:7100", "--port", "7100"]
    cmd = lane_argv(argv, model="b", grpc_port=7101, api_port=41001, data_dir=tmp_path, cluster="c/b",
                    share_file=None, supervisor_url="http://127.0.0.1:8000", public_api_url="http://h:8000", index=1)
    assert cmd[cmd.index("--peers") + 1] == "10.0.0.2:7101,[fe80::1%en0]:7101"
    assert cmd.count("--peers") == 1


def test_aliases_name_a_model_by_value_or_key():
    models = ["smollm2-135m", "/srv/models/Qwen3-4B"]
    assert parse_aliases(["claude-haiku=Qwen3-4B", "chat=smollm2-135m"], models) == {
        "claude-haiku": "/srv/models/Qwen3-4B", "chat": "smollm2-135m"}
    with pytest.raises(RingletError, match="NAME=MODEL"):
        parse_aliases(["claude-haiku"], models)
    with pytest.raises(RingletError, match="not one of the --model values"):
        parse_aliases(["x=gpt-4"], models)


def test_a_models_own_context_is_its_lanes_last_context(tmp_path):
    """``--model-context`` goes to its model's lane as that lane's ``--context``, after the
    node's (``run`` takes the last); the other lanes keep the node's ``--context``."""
    argv = ["run", "--model", "big", "--model", "/m/small", "--context", "32768", "--model-context", "small=4096",
            "--port", "9000"]
    models = ["big", "/m/small"]
    contexts = parse_model_contexts(["small=4096"], models)
    assert contexts == {"/m/small": 4096}
    small = lane_argv(argv, model="/m/small", grpc_port=9001, api_port=41000, data_dir=tmp_path, cluster="c/small",
                      share_file=None, supervisor_url="http://127.0.0.1:8000", public_api_url="http://h:8000",
                      index=1, context=contexts.get("/m/small"))
    big = lane_argv(argv, model="big", grpc_port=9000, api_port=41001, data_dir=tmp_path, cluster="c",
                    share_file=None, supervisor_url="http://127.0.0.1:8000", public_api_url="http://h:8000",
                    context=contexts.get("big"))
    assert "--model-context" not in small + big
    assert small[-2:] == ["--context", "4096"] and small.count("--context") == 2
    assert big.count("--context") == 1 and big[big.index("--context") + 1] == "32768"


@pytest.mark.parametrize(("value", "needle"), [("small", "MODEL=TOKENS"), ("small=0", "not a positive number"),
                                               ("small=lots", "not a positive number"),
                                               ("gpt-4=8192", "not one of the --model values")])
def test_a_bad_model_context_is_one_error_naming_it(value, needle):
    with pytest.raises(RingletError, match=needle):
        parse_model_contexts([value], ["big", "/m/small"])
