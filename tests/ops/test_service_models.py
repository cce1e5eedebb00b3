"""A service of several models (#45 with #42's service): ``ringlet service install --model A
--model B`` keeps both in the configuration, starts ``ringlet run`` with both, the node serves
both, ``ringlet doctor`` checks both, and ``ringlet service upgrade`` brings the node back on
the new release serving both. A real daemon through the stand-in service manager of
test_service_upgrade (there is no systemd here).

Expected values: the bundled model's greedy continuation computed by transformers
(tests/smollm2_135m_instruct_greedy.json, the float32 path) and mlx-lm's whole second model
alone (``tiny_models.whole_model_greedy``); the TOML as TOML states a list of strings.
"""

from __future__ import annotations

import json
import sys
import time
import tomllib
import uuid

import httpx
import pytest
from test_service_upgrade import fake_manager, free_port, healthz, run, service_env, wheels  # noqa: F401 - a fixture
from tiny_models import CONFIGS, make_chat_model, whole_model_greedy

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.service.config import ServiceConfig, config_models, run_arguments

SECOND = {**CONFIGS["llama"], "vocab_size": 98}
SMALL_PROMPT = [5, 17, 42, 90, 8, 50, 3]


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


def test_a_model_list_is_written_read_and_run_as_repeated_options():
    cfg = ServiceConfig(model=["smollm2-135m", "/m/tiny llama"], port=7100)
    again = ServiceConfig.from_toml(cfg.to_toml())
    assert tomllib.loads(cfg.to_toml())["model"] == ["smollm2-135m", "/m/tiny llama"]
    assert config_models(again) == ["smollm2-135m", "/m/tiny llama"]
    assert run_arguments(again) == ["run", "--model", "smollm2-135m", "--model", "/m/tiny llama", "--port", "7100"]
    assert config_models(ServiceConfig(model="smollm2-135m")) == ["smollm2-135m"]
    with pytest.raises(RingletError, match=r"model must be a string or a list of strings, not \['a', 1\]"):
        ServiceConfig.from_toml('model = ["a", 1]')


def test_the_same_model_twice_is_one_error_line(home, tmp_path):
    path = fake_manager(tmp_path)
    r = run(home, [sys.executable, "-m", "ringlet.daemon.ops.cli", "service", "install", "--no-start",
                   "--model", "smollm2-135m", "--model", "smollm2-135m"], path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: model smollm2-135m is given twice; give each model once, the first first"], r.stderr


def completion(api: str, model: str, prompt: list[int], tokens: int) -> list[int]:
    r = httpx.post(f"{api}/v1/completions", timeout=120, trust_env=False, json={
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def wait_serving(api: str, names: list[str], log, timeout_s: float = 240.0) -> dict:
    """Wait until ``/v1/models`` lists every name in ``names`` as serving; returns it."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"{api}/v1/models", timeout=2, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            body = {}
        states = {m["id"]: (m.get("ringlet") or {}).get("state") for m in body.get("data", [])}
        if all(states.get(n) == "serving" for n in names):
            return body
        time.sleep(0.5)
    raise AssertionError(f"not all of {names} serving in {timeout_s:.0f} s: {body}; log: {log()}")


def test_a_service_of_two_models_serves_both_and_upgrades_with_both(home, tmp_path, wheels, reference):  # noqa: F811
    small = make_chat_model("llama", tmp_path / "tiny-llama", SECOND)
    want_small = whole_model_greedy(small, SMALL_PROMPT, 8)
    big_prompt, want_big = reference[0]["prompt_ids"], list(reference[0]["completion_ids"])[:12]
    old_wheel, new_wheel = wheels
    new = new_wheel.name.split("-")[1]
    env = service_env(tmp_path, old_wheel)
    path = fake_manager(tmp_path)
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    ringlet = str(env / "bin" / "ringlet")
    r = run(home, [ringlet, "service", "install", "--model", "smollm2-135m", "--model", str(small),
                   "--dtype", "float32", "--run-arg=--context", "--run-arg=512",
                   "--cluster", f"models-{uuid.uuid4().hex[:8]}", "--interface", "lo", "--host", "127.0.0.1",
                   "--port", str(free_port()), "--api-port", str(api_port), "--data-dir", str(home / "data")], path)
    assert r.returncode == 0, r.stderr

    def log() -> str:
        return (home / "daemon.log").read_text()[-3000:] if (home / "daemon.log").exists() else ""

    config = tomllib.loads((home / ".config/ringlet/service.toml").read_text())
    assert config["model"] == ["smollm2-135m", str(small)]
    unit = (home / ".config/systemd/user/ringlet.service").read_text()
    assert f"--model smollm2-135m --model {small}" in unit
    try:
        wait_serving(api, ["smollm2-135m", "tiny-llama"], log)
        assert completion(api, "smollm2-135m", big_prompt, 12) == want_big
        assert completion(api, "tiny-llama", SMALL_PROMPT, 8) == want_small
        # the doctor reads the service's configuration: it checks both models
        d = run(home, [ringlet, "doctor", "--json"], path)
        checks = {c["name"]: c for c in json.loads(d.stdout)["checks"]}
        assert checks["model"]["status"] == "OK", checks["model"]
        assert [m["path"] for m in checks["model"]["details"]["models"]][1] == str(small)
        assert checks["model"]["summary"].startswith("2 models, ")

        r = run(home, [ringlet, "service", "upgrade", "--wheel", str(new_wheel), "--pip-arg=--no-deps",
                       "--timeout", "240"], path)
        assert r.returncode == 0, r.stdout + r.stderr + log()
        assert healthz(api)["release"] == new
        wait_serving(api, ["smollm2-135m", "tiny-llama"], log)
        assert completion(api, "smollm2-135m", big_prompt, 12) == want_big
        assert completion(api, "tiny-llama", SMALL_PROMPT, 8) == want_small
        cluster = httpx.get(f"{api}/v1/cluster", timeout=5, trust_env=False).json()
        assert [(m["key"], m["state"]) for m in cluster["models"]] == [("smollm2-135m", "serving"),
                                                                         ("tiny-llama", "serving")]
    finally:
        run(home, ["systemctl", "--user", "stop", "ringlet.service"], path, timeout=120)
