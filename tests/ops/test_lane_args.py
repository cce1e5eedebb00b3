"""A model's lane's command line (daemon/ops/lane_args.py) and --model-alias parsing
(daemon/ops/lanes_run.py): expected values written by hand."""

from __future__ import annotations

import sys

import pytest

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.lane_args import lane_argv, lane_key, strip_options
from ringlet.daemon.ops.lanes_run import parse_aliases


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
