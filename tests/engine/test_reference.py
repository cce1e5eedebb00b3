"""The real default model against an independent implementation (transformers, fp32).

``ringlet generate --dtype float32`` must reproduce the reference prompt token ids
(tokenizer and chat template) and the first 20 greedy completion ids.
"""

from __future__ import annotations

import json

import pytest
from conftest import REFERENCE, ringlet

FIRST = 20


@pytest.mark.parametrize("case", REFERENCE, ids=[c["name"] for c in REFERENCE])
def test_float32_greedy_matches_transformers(case):
    if "raw" in case:
        args = [case["raw"]]
    else:
        (message,) = case["messages"]
        assert message["role"] == "user"
        args = ["--chat", message["content"]]
    want = case["completion_ids"][:FIRST]
    proc = ringlet("generate", "--dtype", "float32", "--json", "--max-tokens", str(len(want)), *args)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["prompt_ids"] == case["prompt_ids"]
    assert got["completion_ids"] == want


def test_detokenized_reference_text(default_location):
    """The streaming detokenizer reproduces the reference completion text exactly."""
    from ringlet.daemon.engine.model_info import load_tokenizer

    tok = load_tokenizer(default_location)
    for case in REFERENCE:
        detok = tok.detokenizer
        for t in case["completion_ids"]:
            if t not in tok.eos_token_ids:
                detok.add_token(t)
        detok.finalize()
        assert detok.text == case["completion_text"]


def test_streaming_detokenizer_never_splits_a_character(default_location):
    """Multi-byte characters (accents, CJK, emoji) split across byte-level tokens are
    held back until complete: no U+FFFD in any delta, and the deltas join to the text."""
    from ringlet.daemon.engine.model_info import load_tokenizer

    tok = load_tokenizer(default_location)
    text = "Crème brûlée 🤖🚀 東京 – naïve café ✓"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters take several tokens
    detok = tok.detokenizer
    deltas = []
    for t in ids:
        before = len(detok.text)
        detok.add_token(t)
        deltas.append(detok.text[before:])
    detok.finalize()
    deltas.append(detok.text[len("".join(deltas)):])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
