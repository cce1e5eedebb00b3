"""A second residual stream across stage boundaries (``engine/streams.py``): rwkv7 passes
layer 0's attention value (``v_first``) to every later layer, talkie the normalized
embedding (``e_x``) to every block. A hop carries both, ``2 * hidden_size`` wide.

The zoo (test_zoo.py) shows every split's logits equal to mlx-lm's whole model; here the
carried stream goes through what else uses a stage's boundary: a lost middle stage
rebuilt from the states the stage before it kept (``rebuild``, which runs part of a
stage's layers, :meth:`Stage.span`), in prompt chunks, then decoding on. Expected tokens:
mlx-lm's whole model alone (``tiny_models.whole_model_greedy``); expected widths from the
configs (hidden_size 64).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_rebuild import park_survivors, run_ring
from tiny_models import make_tiny_model, whole_model_greedy
from zoo_models import ZOO

from ringlet.daemon.engine import kv_handoff
from ringlet.daemon.engine.boundary import Boundary
from ringlet.daemon.engine.modelspec import model_spec_from_config
from ringlet.daemon.engine.prefix_store import PrefixStore
from ringlet.daemon.engine.rebuild import rebuild
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage

PROMPT = [5, 17, 42, 99, 8, 150, 3, 77, 12, 64, 33, 21]


@pytest.mark.parametrize("name", ["rwkv7", "talkie"])
def test_the_hop_carries_the_stream_and_the_planner_counts_it(name, tmp_path):
    path = make_tiny_model(name, tmp_path / name, config=ZOO[name])
    location = resolve(str(path))
    first, last = load_stage(location, 0, 2), load_stage(location, 2, 4)
    assert first.hidden_size == last.hidden_size == 2 * 64
    sent = first(mx.array([PROMPT]), first.make_cache())
    assert sent.shape == (1, len(PROMPT), 128)
    logits = last(sent, last.make_cache())
    assert logits.shape == (1, len(PROMPT), 160)
    assert mx.argmax(logits[0, -1]).item() == whole_model_greedy(path, PROMPT, 1)[0]
    spec = model_spec_from_config({**ZOO[name], "torch_dtype": "bfloat16"})
    assert spec.activation_bytes_per_token == 2 * 64 * 2  # two streams of 64, bfloat16


@pytest.mark.parametrize("name", ["rwkv7", "talkie"])
@pytest.mark.parametrize("chunk", [64, 5])
def test_a_lost_middle_stage_is_rebuilt_from_states_that_carry_the_stream(name, chunk, tmp_path):
    """Stages [0, 1) [1, 3) [3, 4) prefill; [1, 3) is lost; the new plan is [0, 2) [2, 4):
    layer 1 is rebuilt from what stage 0 sent on, layer 2 from what that gives, and with
    the survivors' parked states the new stages decode what the whole model decodes."""
    path = make_tiny_model(name, tmp_path / name, config=ZOO[name])
    location = resolve(str(path))
    old = [load_stage(location, s, e) for s, e in ((0, 1), (1, 3), (3, 4))]
    caches, sent = run_ring(old, PROMPT)
    parked = park_survivors(old, caches, PROMPT)
    first, second = load_stage(location, 0, 2), load_stage(location, 2, 4)
    rebuilt_1, out_2 = rebuild(first, 1, 2, [Boundary("", PROMPT, 1, sent[0], inflight=True)], chunk)
    rebuilt_2, out_3 = rebuild(second, 2, 3, out_2, chunk)
    assert len(rebuilt_1) == len(rebuilt_2) == 1 and out_2[0].hidden.shape == (1, len(PROMPT), 128)
    # what leaves the rebuilt layers, the stream included, is what the lost stage sent on
    assert mx.allclose(out_3[0].hidden, sent[1], atol=1e-5).item()
    stores = [PrefixStore(1 << 26, 0, 2), PrefixStore(1 << 26, 2, 4)]
    for store, pieces in zip(stores, ([parked[0], *rebuilt_1], [*rebuilt_2, parked[1]]), strict=True):
        assert kv_handoff.install(store, pieces, store.start, store.end).inflight == 1, name
    new_caches = [store.take("", PROMPT) for store in stores]
    want = whole_model_greedy(path, PROMPT, 5)
    got = [want[0]]
    x = mx.array([[want[0]]])
    for _ in range(4):
        for stage, cache in zip((first, second), new_caches, strict=True):
            x = stage(x, cache)
        got.append(mx.argmax(x[0, -1]).item())
        x = mx.array([[got[-1]]])
    assert got == want, (name, chunk)
