"""``--draft-model`` (issue #34, drafter (c)): stage 0's node drafts with a small model of
the served model's tokenizer where prompt lookup and ``prediction`` give nothing, on real
daemons with the real model (float32).

The draft model here is the bundled model itself (the only model with SmolLM2's
tokenizer on this machine): its greedy drafts are the served model's own greedy tokens,
so nearly all are accepted (a near-tie may round the other way in a verifying forward),
which tests the drafting, its KV cache's trims and the verification together; it cannot
show a speed-up (drafting costs as much as the model). Expected ids: the whole model run
token by token here (:mod:`spec_support`) and transformers' reference ids.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REFERENCE
from spec_support import CASES, WholeModel, assert_same_or_near_tie, chat
from tiny_models import make_tiny_model

from ringlet.daemon.node.config import SPEC_ALWAYS_ENV
from ringlet.daemon.ops.demo import LocalCluster

STOP = {0, 2}  # SmolLM2's <|endoftext|> and <|im_end|>


@pytest.fixture(scope="module")
def whole():
    return WholeModel()


def test_a_draft_model_drafts_where_lookup_cannot_and_greedy_output_is_unchanged(whole):
    with LocalCluster(2, dtype="float32", env={SPEC_ALWAYS_ENV: "1"},
                      extra_args=["--draft-model", "smollm2-135m"]) as c:
        url = c.api_urls[1]  # a node that does not hold stage 0 relays
        story, n, _ = CASES[2]  # free text: no n-gram of the prompt repeats, so only the model drafts
        got = chat(url, story, n)
        want, rows = whole.greedy(got["prompt"], n, STOP)
        assert_same_or_near_tie(got["ids"], want, rows, "story")
        details = got["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= n // 2, details
        case = next(c for c in REFERENCE if "messages" in c)
        ref = chat(url, case["messages"][0]["content"], 20)
        assert ref["prompt"] == case["prompt_ids"] and ref["ids"] == case["completion_ids"][:20]
        spec = c.cluster_info(0)["speculation"]
        assert spec["draft_model"] == "smollm2-135m", spec
        assert spec["acceptance"] >= 0.8 and spec["tokens_per_trip"] > 2, spec


def test_a_draft_model_with_another_tokenizer_is_one_clear_error(tmp_path):
    tiny = make_tiny_model("llama", tmp_path / "tiny")  # a character-level tokenizer of its own
    proc = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "run", "--model", "smollm2-135m",
                           "--draft-model", str(tiny), "--no-mdns", "--no-dashboard", "--port", "0",
                           "--api-port", "0", "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120, env=os.environ)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--draft-model" in errors[0] and "tokenizer differs" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
