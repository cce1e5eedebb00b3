"""Bad input to the CLI: a clear one-line error, a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ringlet
from tiny_models import make_tiny_model


def assert_clean_error(proc, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_wrong_model_path():
    proc = ringlet("generate", "--model", "/no/such/model", "hi")
    assert_clean_error(proc, "not found", "/no/such/model")


def test_unknown_short_name():
    proc = ringlet("generate", "--model", "llama-9000b", "hi")
    assert_clean_error(proc, "not found", "smollm2-135m")


def test_unsupported_architecture(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "transmogrifier"
    (path / "config.json").write_text(json.dumps(config))
    proc = ringlet("run", "--model", str(path), "--port", "1", "--api-port", "1")
    assert_clean_error(proc, "transmogrifier")


def test_truncated_safetensors(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = ringlet("generate", "--model", str(path), "hi")
    assert_clean_error(proc, "truncated", "model.safetensors")


def test_truncated_gguf(tmp_path, default_location):
    cut = tmp_path / "cut.gguf"
    with open(default_location.path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(default_location.path.stat().st_size - 1_000_000))
    proc = ringlet("generate", "--model", str(cut), "hi")
    assert_clean_error(proc, "truncated", "cut.gguf")


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 100)
    proc = ringlet("generate", "--model", str(bad), "hi")
    assert_clean_error(proc, "bad.gguf")


@pytest.mark.parametrize(("plan", "needle"), [
    ("127.0.0.1:7001=0:12,127.0.0.1:7002=10:30", "overlaps"),
    ("127.0.0.1:7001=0:10,127.0.0.1:7002=12:30", "gap"),
    ("127.0.0.1:7001=0:10,127.0.0.1:7002=10:20", "[20, 30) are in no stage"),
    ("127.0.0.1:7001=0:10,127.0.0.1:7002=10:40", "model has 30"),
    ("127.0.0.1:7001=0:0,127.0.0.1:7002=0:30", "empty"),
    ("127.0.0.1:7001=zero:ten", "integers"),
    ("nonsense", "HOST:PORT=START:END"),
])
def test_bad_layer_ranges(plan, needle):
    proc = ringlet("run", "--plan", plan, "--port", "7001", "--api-port", "7002")
    assert_clean_error(proc, needle)


def test_node_not_in_plan():
    proc = ringlet("run", "--plan", "127.0.0.1:7001=0:30", "--port", "7005", "--api-port", "7006")
    assert_clean_error(proc, "not a stage")


def test_model_dir_without_weights(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m")
    shutil.move(path / "model.safetensors", tmp_path / "elsewhere.safetensors")
    proc = ringlet("generate", "--model", str(path), "hi")
    assert_clean_error(proc, "no *.safetensors")


@pytest.mark.parametrize(("value", "needle"), [("other=300", "'other' is not one of the --model values (smollm2-135m)"),
                                               ("smollm2-135m=-1", "not a positive number of tokens")])
def test_a_model_context_for_no_served_model_is_refused_before_loading(value, needle):
    proc = ringlet("run", "--no-mdns", "--no-dashboard", "--port", "0", "--model-context", value)
    assert_clean_error(proc, "--model-context", needle)
