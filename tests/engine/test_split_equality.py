"""Exact split equality: every 1-4 stage split of tiny models of several architectures
gives logits equal (``array_equal``) to the unsplit model, for prefill and 5 decode steps.

The expected logits come from mlx-lm's own loader and forward pass
(``mlx_lm.utils.load_model`` + ``make_prompt_cache``), not from ringlet's stage code.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from tiny_models import CONFIGS, NUM_LAYERS, make_tiny_model

from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage

PROMPT = [3, 17, 42, 99, 5, 150, 8]
DECODE_STEPS = 5


def all_splits(num_layers: int, max_stages: int = 4, min_stages: int = 1):
    """Every way to cut [0, num_layers) into min_stages..max_stages contiguous non-empty
    ranges (also used by test_zoo.py)."""
    for k in range(min_stages, max_stages + 1):
        for cuts in itertools.combinations(range(1, num_layers), k - 1):
            bounds = (0, *cuts, num_layers)
            yield [(bounds[i], bounds[i + 1]) for i in range(k)]


def test_all_splits_enumerates_the_compositions():
    # 4 layers: C(3,0)+C(3,1)+C(3,2)+C(3,3) = 1+3+3+1 = 8 splits.
    splits = list(all_splits(4))
    assert len(splits) == 8
    assert [(0, 1), (1, 2), (2, 3), (3, 4)] in splits and [(0, 3), (3, 4)] in splits


def reference_logits(path):
    """Single-process logits from mlx-lm itself: prefill, then DECODE_STEPS greedy steps."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    out = []
    logits = model(mx.array([PROMPT]), cache=cache)
    mx.eval(logits)
    out.append(logits)
    for _ in range(DECODE_STEPS):
        token = mx.argmax(logits[0, -1]).item()
        logits = model(mx.array([[token]]), cache=cache)
        mx.eval(logits)
        out.append(logits)
    return out


def split_logits(stages):
    caches = [s.make_cache() for s in stages]
    out = []
    x = mx.array([PROMPT])
    for _ in range(DECODE_STEPS + 1):
        h = x
        for stage, cache in zip(stages, caches, strict=True):
            h = stage(h, cache)
            mx.eval(h)
        out.append(h)
        x = mx.array([[mx.argmax(h[0, -1]).item()]])
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_split_equals_single_process(arch, tmp_path):
    path = make_tiny_model(arch, tmp_path / arch)
    expected = reference_logits(path)
    location = resolve(str(path))
    checked = 0
    for split in all_splits(NUM_LAYERS):
        stages = [load_stage(location, start, end) for start, end in split]
        got = split_logits(stages)
        for step, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert g.shape == e.shape, (split, step)
            assert mx.array_equal(g, e).item(), f"{arch} split {split}: logits differ at step {step}"
        checked += 1
    assert checked == 8


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_stage_holds_only_its_layers(arch, tmp_path):
    path = make_tiny_model(arch, tmp_path / arch)
    location = resolve(str(path))
    middle = load_stage(location, 1, 3)
    names = {k for k, _ in tree_flatten(middle.model.parameters())}
    assert names, "the stage holds nothing"
    assert all(n.startswith("model.layers.0.") or n.startswith("model.layers.1.") for n in names), sorted(names)[:5]
    assert len(middle.model.layers) == 2


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_engines_head_call_projects_only_the_last_position(arch, tmp_path):
    """``head=True`` (how the engine asks a last stage for the next token's logits) gives
    the last position only, ``(1, 1, vocab)``, equal to that row of mlx-lm's own logits,
    for tied (qwen3 here) and untied heads; the stage's other calls are unchanged."""
    path = make_tiny_model(arch, tmp_path / arch)
    expected = reference_logits(path)[0][0, -1]  # the prefill's last row
    location = resolve(str(path))
    for start in range(NUM_LAYERS):  # the last stage of every 2-stage split, and the whole model
        first = load_stage(location, 0, start) if start else None
        last = load_stage(location, start, NUM_LAYERS)
        x = mx.array([PROMPT])
        if first is not None:
            x = first(x, first.make_cache())
        got = last(x, last.make_cache(), head=True)
        assert got.shape == (1, 1, expected.shape[-1]), (start, got.shape)
        assert mx.allclose(got[0, -1], expected, rtol=1e-5, atol=1e-5).item(), start
        assert last(x, last.make_cache()).shape[1] == len(PROMPT)  # head=None: every position
