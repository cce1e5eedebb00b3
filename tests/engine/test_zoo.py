"""The split zoo: every text architecture of the installed mlx-lm, split every way into
1-4 stages, gives logits equal (``array_equal``) to mlx-lm's whole model -- prefill and
5 greedy decode steps -- or is refused up front by ``load_stage`` with a reason; never
wrong logits, never a crash.

Expected logits come from mlx-lm alone (``mlx_lm.utils.load_model``,
``make_prompt_cache``, the model's forward). Models: tests/zoo_models.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_split_equality import all_splits, reference_logits, split_logits
from tiny_models import make_tiny_model
from zoo_models import ZOO

from ringlet.daemon.engine.layer_pattern import REFUSED, SPLIT_VERIFIED, UNVERIFIED_ENV, check_split
from ringlet.daemon.engine.modelspec import model_spec_from_config
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage
from ringlet.daemon.errors import PlanError
from ringlet.daemon.tensor.group import model_tp_spec
from ringlet.daemon.tensor.planning.inputs import tensor_refusal


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_split_is_exact_or_refused(name, tmp_path, monkeypatch):
    # the zoo checks the rules themselves: unverified splits are let run here, and
    # SPLIT_VERIFIED must then be exactly the architectures found exact
    monkeypatch.setenv(UNVERIFIED_ENV, "1")
    config = ZOO[name]
    path = make_tiny_model(config["model_type"], tmp_path / name, config=config)
    expected = reference_logits(path)
    location = resolve(str(path))
    whole = load_stage(location, 0)
    n = whole.num_layers
    # what a daemon computes at start-up to plan (rwkv7, without attention heads, crashed it)
    spec, tp = model_tp_spec(location, None), model_spec_from_config(config)
    assert len(tp.layer_bytes) == spec.num_layers == n and tensor_refusal(spec, 2) != ""
    assert all(mx.array_equal(g, e).item() for g, e in zip(split_logits([whole]), expected, strict=True))
    refusals, exact = [], 0
    for split in all_splits(n, min_stages=2):
        try:
            stages = [load_stage(location, start, end) for start, end in split]
        except PlanError as exc:
            refusals.append(str(exc))
            continue
        got = split_logits(stages)
        for step, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert g.shape == e.shape and mx.array_equal(g, e).item(), f"{name} {split}: logits differ at step {step}"
        exact += 1
    if refusals:  # refused up front: every split, naming the architecture and why
        assert exact == 0, f"{name}: some splits refused, others run: {refusals[0]}"
        assert f"{config['model_type']!r} cannot be split" in refusals[0]
        assert config["model_type"] in REFUSED or "different kinds" in refusals[0], refusals[0]
    assert (exact > 0) == (config["model_type"] in SPLIT_VERIFIED), \
        f"{name}: SPLIT_VERIFIED must list exactly the architectures the zoo finds exact"


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "plamo", "phixtral", "recurrent_gemma", "lfm2", "nanochat",
                                  "bailing_moe_linear"])
def test_a_reshard_reusing_the_old_stages_modules_is_exact(name, tmp_path):
    """A re-shard (``load_stage(..., reuse=old)``, node/core.py) takes the layers, embedding,
    final norm and head the new stage shares with the old one, whatever the architecture
    names them (``h``/``ln_f`` in gpt2.py, ``final_layer_norm`` in gpt_neox.py, ``layers.layers``
    in plamo.py, ``final_norm`` in recurrent_gemma.py), reads only the rest, and its logits
    still equal mlx-lm's whole model."""
    config = ZOO[name]
    path = make_tiny_model(config["model_type"], tmp_path / name, config=config)
    expected = reference_logits(path)
    location = resolve(str(path))
    n = load_stage(location, 0).num_layers
    first = load_stage(location, 0, 2, reuse=load_stage(location, 0, 1))
    last = load_stage(location, 2, n, reuse=load_stage(location, 1, n))
    for stage in (first, last):
        assert stage.reused_prefixes and stage.loaded_bytes() < stage.nbytes(), (name, stage.reused_prefixes)
    for step, (e, g) in enumerate(zip(expected, split_logits([first, last]), strict=True)):
        assert mx.array_equal(g, e).item(), f"{name}: logits differ at step {step} after a re-shard"


def test_a_split_of_an_architecture_the_zoo_has_not_verified_is_refused(monkeypatch):
    monkeypatch.delenv(UNVERIFIED_ENV, raising=False)
    with pytest.raises(PlanError, match="not yet verified"):
        check_split("bitnet", None)
    check_split("kimi_k2", None, module="deepseek_v3")  # mlx-lm runs it as deepseek_v3: verified
    check_split("mistral", None, module="llama")
    with pytest.raises(PlanError, match="not yet verified"):
        check_split("bitnet", None, module="bitnet")
    monkeypatch.setenv(UNVERIFIED_ENV, "1")
    check_split("bitnet", None)  # the user's explicit choice


#: mlx_lm.models modules that are not architectures (shared building blocks).
HELPERS = frozenset({"activations", "base", "cache", "gated_delta", "mla", "pipeline", "rope_utils", "ssm",
                     "switch_layers", "bitlinear_layers"})

#: Architectures the zoo cannot build on this machine, and why: load_stage refuses to split them
#: (they are not in layer_pattern.SPLIT_VERIFIED; RINGLET_SPLIT_UNVERIFIED=1 lets a split run).
NOT_IN_ZOO: dict[str, str] = {
    "bitnet": "its BitLinear layers run a Metal kernel (bitlinear_layers.py mx.fast.metal_kernel): no Metal here",
    "olmo": "olmo.py imports hf_olmo (the ai2-olmo package, which needs torch) and exits without it",
    "prism_hadamard_qwen35": "its ModelArgs requires a packed 2-bit Hadamard manifest (prism_hadamard_qwen35.py "
                             "ModelArgs.__post_init__), not a config written by hand",
}


def test_every_mlx_lm_architecture_is_classified():
    """A new mlx-lm release that adds an architecture fails here until it is in the zoo
    (split and compared above), refused with a reason (layer_pattern.REFUSED), or listed
    with a reason the zoo cannot build it (NOT_IN_ZOO)."""
    import pkgutil

    import mlx_lm.models

    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)} - HELPERS
    zoo = {config["model_type"] for config in ZOO.values()}
    unclassified = sorted(modules - zoo - set(REFUSED) - set(NOT_IN_ZOO))
    assert not unclassified, f"mlx-lm architectures neither in the zoo, refused nor listed: {unclassified}"
    assert all(reason for reason in (*REFUSED.values(), *NOT_IN_ZOO.values()))
    assert not (zoo & set(NOT_IN_ZOO)) and not (set(REFUSED) & set(NOT_IN_ZOO))
    assert not (SPLIT_VERIFIED & set(NOT_IN_ZOO))
