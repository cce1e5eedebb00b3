"""Refuse, never overfill (#43 must-have 4): a request whose KV would take a node past its
memory ends with an error naming the figures — at once, not a hung stream or a resume
loop — instead of allocating; the node stays up and serves the requests that fit.

One daemon of a random float32 llama whose KV is large beside its weights (hidden 128, 4
layers of 4 KV heads x 64: 4 x 2 x 4 x 64 x 4 B = 8,192 B of KV per token; 0.92 MB of
weights per layer) with ``--memory-limit 25MB`` and a 512-token planning context. It
offers 25 MB less a sixteenth (the boundary store), 8 MiB for its tokenizer (the least
planned) and its work space: per 256-token chunk
token (2 + 4) x 128 + 256 + 2 x 256 + 3 x 256 = 2,304 floats, 4 x 256 x 512 scores and 16 x
98 logits, x 4 B x 1.5 = 6,694,080 B (daemon/engine/work_space.py's terms). What its
weights leave of that is its KV room."""

from __future__ import annotations

import httpx
from tiny_models import make_chat_model

from ringlet.daemon.ops.demo import LocalCluster

LIMIT = 25_000_000
TOKENIZER = 8 << 20
WORK = 6 * (256 * 2304 + 4 * 256 * 512 + 16 * 98)
PER_TOKEN = 4 * 2 * 4 * 64 * 4
CONFIG = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5,
          "vocab_size": 98, "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}


def complete(url: str, n: int, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": [(7 * i) % 95 + 3 for i in range(n)], "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True})


def test_a_request_beyond_the_nodes_kv_room_ends_with_the_reason_and_the_node_serves_on(tmp_path):
    assert WORK == 6_694_080
    model = make_chat_model("llama", tmp_path / "model", CONFIG)
    with LocalCluster(1, model=str(model), dynamic=True,
                      extra_args=["--memory-limit", "25MB", "--context", "512"]) as c:
        url = c.api_urls[0]
        weights = c.cluster_info(0)["memory"]["weights_bytes"]
        room = LIMIT - LIMIT // 16 - WORK - TOKENIZER - weights
        fits = room // PER_TOKEN
        assert 300 < fits < 1000, (room, weights)  # the test's sizes hold: a short prompt fits, a long one not
        ok = complete(url, fits // 2)
        assert ok.status_code == 200, ok.text
        resp = complete(url, 2 * fits)
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert "no memory for" in message and f"room for about {fits} tokens" in message, (message, fits)
        assert "add a node or memory" in message
        assert c.alive() == [0]
        events = [e["message"] for e in c.cluster_info(0)["events"] if e["kind"] == "memory"]
        assert any("found no memory for it and ended" in m for m in events), events
        assert not any("resumes" in e["message"] for e in c.cluster_info(0)["events"])  # ended, not resumed
        again = complete(url, fits // 2)  # the node serves on, and the refused request left nothing behind
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["token_ids"] == ok.json()["choices"][0]["token_ids"]
        assert c.cluster_info(0)["memory"]["kv_cache_bytes"] == 0
        print(f"\nKV room {room / 1e6:.1f} MB (about {fits} tokens); refused a {2 * fits}-token prompt: {message}")
