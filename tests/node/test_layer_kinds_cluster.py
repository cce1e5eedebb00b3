"""Architectures whose stage boundaries needed more than plain hidden states, through real
daemons: tiny rwkv7- and talkie-like models (each hop carries ``v_first`` or the normalized
embedding beside the hidden states, twice as wide: engine/streams.py), nemotron_h- and
nemotron-nas-like ones (layers that cache nothing, given length caches:
engine/cacheless.py) on a 2-daemon ring, a 2-turn chat whose second turn reuses the first's
end state from both stages' prefix stores.

Expected token ids: mlx-lm's whole model alone (``tiny_models.whole_model_greedy``, the
prompt in one forward); expected reuse: the previous turn's prompt and answer but its last
token (which no stage computed), the length a recurrent state is reusable at and the
longest a plain KV cache holds.
"""

from __future__ import annotations

import httpx
import pytest
from tiny_models import make_chat_model, whole_model_greedy
from zoo_models import ZOO

from ringlet.daemon.ops.demo import LocalCluster

MODELS = {
    "rwkv7": {**ZOO["rwkv7"], "vocab_size": 98},
    "talkie": {**ZOO["talkie"], "vocab_size": 98},
    "nemotron_h": {**ZOO["nemotron_h"], "vocab_size": 98, "max_position_embeddings": 4096},
    "nemotron-nas": {**ZOO["nemotron-nas"], "vocab_size": 98},
}
TURNS = ([5, 17, 42, 90, 8, 50, 3, 77, 12, 64], [33, 21, 9, 40])
ANSWER = 8


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_two_stage_chat_equals_the_whole_model(name, tmp_path):
    path = str(make_chat_model(name, tmp_path / name, MODELS[name]))
    with LocalCluster(2, model=path, dynamic=True) as c:  # as `ringlet run` starts: discovery, negotiation
        plan = c.wait_plan(stages=2)
        url = c.api_urls[0]
        prompt: list[int] = []
        for turn, user in enumerate(TURNS):
            previous = len(prompt) if turn else 1
            prompt = prompt + user
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            got = body["choices"][0]["token_ids"]
            assert got == whole_model_greedy(path, prompt, ANSWER), (name, turn, plan["plan"])
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == previous - 1, (name, turn)
            prompt = prompt + got
