"""A model directory holding only some of its safetensors files (what a node that
downloaded only its own layers from the Hub has): its stage loads from the files present
with the same weights mlx-lm loads from the whole directory, a stage needing an absent
file is refused by name, and the whole model is sized from the headers alone exactly as
mlx-lm builds it from every file.

Expected values come from mlx-lm's own loader on the complete directory and from the
``safetensors`` package's reading of the files; never from the code under test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from safetensors import safe_open
from tiny_models import NUM_LAYERS, sharded_model_files, stage_file_names

from ringlet.daemon.engine.partial_model import absent_files, write_headers_file
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.engine.stage import build_lazy_model, load_stage
from ringlet.daemon.errors import ModelFormatError


def _partial_copy(full: Path, dest: Path, keep: set[str]) -> Path:
    """``full`` without the safetensors files not in ``keep``."""
    shutil.copytree(full, dest)
    for f in dest.glob("*.safetensors"):
        if f.name not in keep:
            f.unlink()
    return dest


def _headers_file(full: Path, path: Path) -> Path:
    """Every safetensors header of ``full``, as read by the ``safetensors`` package."""
    files = {}
    for f in sorted(full.glob("*.safetensors")):
        with safe_open(str(f), "np") as fh:
            tensors = {}
            for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                sl = fh.get_slice(name)
                tensors[name] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
        files[f.name] = {"tensors": tensors}
    write_headers_file(path, files, repo="test-org/tiny", revision="0" * 40)
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("full") / "tiny"
    sharded_model_files(directory=directory)
    return directory


def test_a_stage_loads_from_the_files_present_with_mlx_lms_weights(full, tmp_path):
    from mlx_lm.utils import load_model

    keep = stage_file_names(1, 3)
    assert keep == {"model-00003-of-00006.safetensors", "model-00004-of-00006.safetensors"}
    partial = _partial_copy(full, tmp_path / "partial", keep)
    location = ModelLocation("tiny", "mlx", partial)
    assert len(absent_files(location)) == 4
    stage = load_stage(location, 1, 3)
    reference, _ = load_model(full)  # mlx-lm, every file
    got = dict(tree_flatten(stage.model.parameters()))
    for i in (1, 2):
        want = dict(tree_flatten(reference.layers[i].parameters()))
        for name, value in want.items():
            assert mx.array_equal(got[f"model.layers.{i - 1}.{name}"], value), (i, name)
    # nothing of the embedding or the head was read: the stage holds its two layers only
    layer_bytes = sum(v.nbytes for i in (1, 2) for _, v in tree_flatten(reference.layers[i].parameters()))
    assert stage.nbytes() == layer_bytes


def test_a_stage_whose_file_is_absent_is_refused_by_name(full, tmp_path):
    partial = _partial_copy(full, tmp_path / "partial", stage_file_names(1, 3))
    with pytest.raises(ModelFormatError, match=r"layers \[0, 2\) need .*model-00001-of-00006\.safetensors"):
        load_stage(ModelLocation("tiny", "mlx", partial), 0, 2)  # the embedding is not here
    with pytest.raises(ModelFormatError, match=r"layers \[3, 4\) need .*model-00005-of-00006\.safetensors"):
        load_stage(ModelLocation("tiny", "mlx", partial), 3, 4)


@pytest.mark.parametrize("bits", [None, 4])
def test_the_whole_model_is_sized_from_headers_as_mlx_lm_builds_it(tmp_path, bits):
    from mlx_lm.utils import load_model

    full = tmp_path / "full"
    sharded_model_files(directory=full, bits=bits)
    partial = _partial_copy(full, tmp_path / "partial", stage_file_names(NUM_LAYERS - 1, NUM_LAYERS))
    headers = _headers_file(full, tmp_path / "headers.json")
    model, _ = build_lazy_model(ModelLocation("tiny", "mlx", partial, revision="0" * 40, headers=headers))
    reference, _ = load_model(full, lazy=True)
    want = {k: (v.shape, v.dtype) for k, v in tree_flatten(reference.parameters())}
    got = {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())}
    assert got == want
    if bits:  # quantized as the checkpoint is: packed uint32 weights with scales
        assert got["model.layers.0.mlp.up_proj.weight"][1] == mx.uint32
        assert "model.layers.0.mlp.up_proj.scales" in got
