"""Rebuilding a lost stage's KV from boundary activations, in process, on tiny models of
several architectures and on the bundled model.

Expected values come from mlx-lm's own loader and forward pass on the whole model
(``mlx_lm.utils.load_model`` + ``make_prompt_cache``): its KV cache per layer after the
prompt, and its logits for the greedy decode steps after it.

The scenario: stages ``[0, 1) [1, 3) [3, 4)`` prefill a prompt, stage 0 keeping the hidden
states it sent on. The middle stage is lost; the new plan is ``[0, 2) [2, 4)``. The first
new stage rebuilds layer 1 from stage 0's states (and serves what leaves layer 2); the
second rebuilds layer 2 from those. Joined with the KV the survivors kept (layers 0 and
3), the new stages decode exactly what the whole model decodes.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import CONFIGS, make_tiny_model

from ringlet.daemon.engine.boundary import Boundary, BoundaryReader, to_chunks
from ringlet.daemon.engine.kv_pieces import Piece, assemble
from ringlet.daemon.engine.prefix_store import caches_from, snapshot
from ringlet.daemon.engine.rebuild import Rebuild, rebuild
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage
from ringlet.daemon.errors import PlanError

PROMPT = [3, 17, 42, 99, 5, 150, 8, 61, 12]
STEPS = 4
# architectures whose layers all cache plain KVCache (deepseek_v3's MLA does too)
ARCHS = sorted(a for a in CONFIGS)


def reference(path):
    """mlx-lm's whole model: its KV after the prompt (per layer, keys and values) and the
    logits of STEPS greedy decode steps after it."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)
    kv = snapshot(cache, len(PROMPT))
    steps = []
    for _ in range(STEPS):
        token = mx.argmax(logits[0, -1]).item()
        logits = model(mx.array([[token]]), cache=cache)
        mx.eval(logits)
        steps.append((token, logits))
    return kv, steps


def run_ring(stages: list, prompt: list[int]) -> tuple[list[list], list[mx.array]]:
    """Prefill ``prompt`` through ``stages`` in order as a ring would, in one piece: each
    stage's fresh caches, and the hidden states each stage sent on (shape
    ``(1, len(prompt), hidden)``; the last is the last stage's output)."""
    caches = [s.make_cache() for s in stages]
    h = mx.array([prompt])
    sent = []
    for stage, cache in zip(stages, caches, strict=True):
        h = stage(h, cache)
        mx.eval(h)
        sent.append(h)
    return caches, sent


def park_survivors(stages: list, caches: list[list], prompt: list[int]) -> list[Piece]:
    """The pieces the first and last of ``stages`` park (``kv_handoff.park``) for one
    request in flight over ``prompt``, holding ``caches`` (from :func:`run_ring`), when
    the stages between them are lost."""
    from ringlet.daemon.engine import kv_handoff
    from ringlet.daemon.engine.prefix_store import PrefixStore

    state = type("State", (), {"tokens": prompt, "offset": len(prompt), "scope": "", "cache": None})
    parked = []
    for stage, cache in ((stages[0], caches[0]), (stages[-1], caches[-1])):
        state.cache = cache
        parked += kv_handoff.park(stage, {"r": state}, PrefixStore(0, stage.start, stage.end))
    return parked


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [64, 4])
def test_a_lost_middle_stage_is_rebuilt_in_chain_and_decodes_as_the_whole_model(arch, chunk, tmp_path):
    path = make_tiny_model(arch, tmp_path / arch)
    ref_kv, ref_steps = reference(path)
    loc = resolve(str(path))
    old = [load_stage(loc, 0, 1), load_stage(loc, 1, 3), load_stage(loc, 3, 4)]
    caches, sent = run_ring(old, PROMPT)
    kept0 = Piece("", PROMPT, 0, 1, snapshot(caches[0], len(PROMPT)), inflight=True)
    kept3 = Piece("", PROMPT, 3, 4, snapshot(caches[2], len(PROMPT)), inflight=True)
    states_at_1 = Boundary("", PROMPT, 1, sent[0], inflight=True)

    first, second = load_stage(loc, 0, 2), load_stage(loc, 2, 4)
    pieces_1, out_2 = rebuild(first, 1, 2, [states_at_1], chunk)
    pieces_2, out_3 = rebuild(second, 2, 3, out_2, chunk)
    assert [b.layer for b in out_2 + out_3] == [2, 3]
    for layer, piece in ((1, pieces_1[0]), (2, pieces_2[0])):
        (k, v), (rk, rv) = piece.layers[0], ref_kv[layer]
        if chunk >= len(PROMPT):  # one forward over the prompt, as the lost stage ran it: the same operations
            assert mx.array_equal(k, rk).item() and mx.array_equal(v, rv).item(), (arch, layer)
        else:  # other matmul shapes: equal to float32 rounding
            assert mx.allclose(k, rk, atol=1e-5).item() and mx.allclose(v, rv, atol=1e-5).item(), (arch, layer)
    # what leaves the rebuilt layers is what the lost stage sent on
    assert mx.allclose(out_3[0].hidden, sent[1], atol=1e-5).item()

    joined = [assemble([kept0, *pieces_1], 0, 2), assemble([*pieces_2, kept3], 2, 4)]
    assert [len(j) for j in joined] == [1, 1]
    new_caches = [caches_from(j[0].layers, len(PROMPT)) for j in joined]
    for token, want in ref_steps:
        x = mx.array([[token]])
        for s, c in zip((first, second), new_caches, strict=True):
            x = s(x, c)
        mx.eval(x)
        assert mx.allclose(x, want, atol=1e-4).item(), arch
        assert mx.argmax(x[0, -1]).item() == mx.argmax(want[0, -1]).item()


def test_layer_zero_is_rebuilt_from_the_token_ids_and_a_span_restores_the_stage(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama")
    ref_kv, _ = reference(path)
    stage = load_stage(resolve(str(path)), 0, 4)
    pieces, outs = rebuild(stage, 0, 2, [Boundary("s", PROMPT, 0, None)], 64)
    assert [len(p.layers) for p in pieces] == [2] and outs[0].hidden.shape == (1, len(PROMPT), 64)
    for i in range(2):
        assert mx.array_equal(pieces[0].layers[i][0], ref_kv[i][0]).item()
    # the whole stage runs again after the span: its logits are the model's
    logits = stage(mx.array([PROMPT]), stage.make_cache())
    assert logits.shape == (1, len(PROMPT), CONFIGS["llama"]["vocab_size"])
    with pytest.raises(PlanError, match=r"layers \[2, 6\)"):
        Rebuild(stage, 2, 6, outs[0], 64).step()


def test_unusable_inputs_are_skipped():
    """States of another length than the tokens, and a sequence with no tokens, give nothing."""
    stage = load_stage(resolve(None), 0, 2, dtype="float32")
    bad = Boundary("", [1, 2, 3], 1, mx.zeros((1, 2, stage.hidden_size)))
    empty = Boundary("", [], 1, mx.zeros((1, 0, stage.hidden_size)))
    assert rebuild(stage, 1, 2, [bad, empty], 64) == ([], [])


def test_states_cross_the_wire_whole_in_chunks_and_bfloat16():
    hidden = (mx.arange(2 * 5 * 8).reshape(1, 10, 8) / 7).astype(mx.bfloat16)
    sent = [Boundary("a", list(range(10)), 4, hidden, True), Boundary("b", [7, 8], 4, hidden[:, :2])]
    reader = BoundaryReader(4, 8, mx.bfloat16, 1 << 20)
    chunks = list(to_chunks(sent, 3 * 8 * 2))  # 3 tokens of 8 bfloat16 values a chunk
    assert len(chunks) == (1 + 4) + (1 + 1)  # per sequence its ids, then its states 3 tokens a chunk
    for c in chunks:
        reader.add(c)
    got = reader.boundaries()
    assert [(b.scope, b.tokens, b.inflight) for b in got] == [("a", list(range(10)), True), ("b", [7, 8], False)]
    assert mx.array_equal(got[0].hidden, hidden).item() and got[0].hidden.dtype == mx.bfloat16
    # at layer 0 only the token ids travel
    zero = BoundaryReader(0, 8, None, 1 << 20)
    for c in to_chunks([Boundary("z", [1, 2], 0, None)], 64):
        zero.add(c)
    assert [(b.tokens, b.hidden) for b in zero.boundaries()] == [([1, 2], None)]


def test_a_request_parked_mid_verification_leaves_only_its_confirmed_tokens(tmp_path):
    """A re-plan catches a request on stage ``[0, 2)`` after it sent on a verifying step
    (its latest token and 3 drafts) and before the verdict: the KV and boundary states it
    parks hold the prompt alone (the drafts may be rejected), so the finished turn that
    repeats the prompt covers it and one sequence is rebuilt, not two (CI, stop 39: a
    2,180-token turn and a 2,181-token request in flight were both rebuilt). Expected
    values: the stage's own forward over the prompt alone, in one piece."""
    from ringlet.daemon.engine.boundary import BoundaryStore
    from ringlet.daemon.engine.scheduler import StageEngine, _RequestState
    from ringlet.daemon.node.rebuild import covering

    loc = resolve(str(make_tiny_model("llama", tmp_path / "llama")))
    stage = load_stage(loc, 0, 2)
    boundaries = BoundaryStore(1 << 26, layer=2)
    engine = StageEngine(stage, StageEngine.new_executor(), boundaries=boundaries)
    state = _RequestState(stage.make_cache(), None, tokens=[], boundary=boundaries.begin("", []))
    drafts = [7, 7, 7]
    for chunk, verifying in ((PROMPT[:-1], False), ([PROMPT[-1], *drafts], True)):  # as _finish_one counts them
        out = stage(mx.array([chunk]), state.cache)
        state.tokens += chunk
        state.offset += len(chunk)
        state.drafted_from = state.offset - len(chunk) if verifying else None
        state.boundary = boundaries.record(state.boundary, out)
    engine._requests["r"] = state

    # while it still serves (a joiner fetching KV), its pieces leave the drafts out and it keeps them
    (held,) = engine.kv_pieces()
    assert held.tokens == PROMPT and held.layers[0][0].shape[2] == len(PROMPT)
    assert state.offset == len(PROMPT) + len(drafts) and state.drafted_from == len(PROMPT) - 1
    pieces, parked = engine.swap(load_stage(loc, 0, 3), keep=True)

    want_cache = stage.make_cache()
    want_out = stage(mx.array([PROMPT]), want_cache)
    (piece,) = pieces
    assert piece.tokens == PROMPT and piece.inflight
    for (k, v), c in zip(piece.layers, want_cache, strict=True):
        assert k.shape[2] == len(PROMPT)
        assert mx.allclose(k, c.keys[..., :len(PROMPT), :], atol=1e-5).item()
        assert mx.allclose(v, c.values[..., :len(PROMPT), :], atol=1e-5).item()
    (states,) = parked
    assert states.tokens == PROMPT and states.inflight and states.hidden.shape[1] == len(PROMPT)
    assert mx.allclose(states.hidden, want_out, atol=1e-5).item()
    finished = Boundary("", [*PROMPT, 9, 4], 2, mx.concatenate([want_out, want_out[:, :2]], axis=1))
    assert [b.tokens for b in covering([finished, states])] == [finished.tokens]
