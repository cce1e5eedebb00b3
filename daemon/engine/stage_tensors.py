"""Which tensors of an MLX/Hugging Face checkpoint a stage ``[start, end)`` needs, by name,
and which of a sharded checkpoint's files hold them.

The rule is shared by everything that moves or loads only part of a model: the peer
transfer (:mod:`ringlet.daemon.shards.selection`), the Hub download
(:mod:`ringlet.daemon.shards.hub_fetch`) and the check that a partial model directory
holds a stage (:mod:`ringlet.daemon.engine.partial_model`). No I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ringlet.daemon.errors import PlanError

#: ``layers.N.`` anywhere in an MLX/Hugging Face tensor name (``model.layers.3.mlp...``).
MLX_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def validate_range(start: int, end: int, num_layers: int) -> None:
    """Check a half-open layer range ``[start, end)`` against a model of ``num_layers``.

    Raises:
        PlanError: empty, reversed or out-of-bounds range.
    """
    if not (0 <= start < end <= num_layers):
        raise PlanError(f"layer range [{start}, {end}) is not a non-empty range within [0, {num_layers})")


def select_mlx(names: Iterable[str], num_layers: int, start: int, end: int) -> list[str]:
    """Tensors of an MLX/Hugging Face checkpoint the stage ``[start, end)`` needs: the
    ``layers.N.`` tensors of its layers; the embedding (``embed_tokens``) on the first
    stage and, when the head is tied (no ``lm_head``), on the last; the head and any other
    ``norm`` outside the layers on the last; every other tensor outside the layers on
    every stage (the stage loader drops what it does not use before reading).

    Raises:
        PlanError: a layer range outside the model.
    """
    names = list(names)
    validate_range(start, end, num_layers)
    first, last = start == 0, end == num_layers
    tied = not any("lm_head" in n for n in names)
    out = []
    for name in names:
        m = MLX_LAYER.search(name)
        if m:
            keep = start <= int(m.group(1)) < end
        elif "embed_tokens" in name:
            keep = first or (last and tied)
        elif "lm_head" in name or "norm" in name:
            keep = last
        else:
            keep = True
        if keep:
            out.append(name)
    return out


def stage_files(weight_map: Mapping[str, str], num_layers: int, start: int, end: int) -> list[str]:
    """The files of a sharded checkpoint (``model.safetensors.index.json``'s ``weight_map``:
    tensor name -> file) that hold a tensor the stage ``[start, end)`` needs, sorted.

    Raises:
        PlanError: a layer range outside the model.
    """
    return sorted({weight_map[n] for n in select_mlx(weight_map, num_layers, start, end)})


def layers_present(weight_map: Mapping[str, str], num_layers: int, present: set[str]) -> list[int]:
    """Decoder layers all of whose tensors are in the files ``present`` (file names)."""
    missing = set()
    for name, file in weight_map.items():
        m = MLX_LAYER.search(name)
        if m and file not in present:
            missing.add(int(m.group(1)))
    return [i for i in range(num_layers) if i not in missing]
