"""Which tensors a stage ``[start, end)`` needs, by name: the rule for GGUF files
(:func:`select_gguf`, the loader's own rule) and for MLX/Hugging Face checkpoints
(:func:`select_mlx`). No I/O beyond reading a local GGUF header.
"""

from __future__ import annotations

import re
from pathlib import Path

from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.shards.gguf_header import read_gguf_header
from ringlet.daemon.shards.layout import Region


def select_gguf(regions: dict[str, Region], block_count: int, start: int, end: int) -> list[str]:
    """GGUF tensor names the stage ``[start, end)`` needs, with the selection rule of
    :func:`ringlet.daemon.engine.gguf.stage_tensor_names` (blocks in range; the embedding on the
    first stage; the final norm and the head on the last, the embedding when tied).

    Raises:
        PlanError: a layer range outside the model.
    """
    from types import SimpleNamespace

    from ringlet.daemon.engine.stage import validate_range

    validate_range(start, end, block_count)
    view = SimpleNamespace(tensors=regions, config={"tie_word_embeddings": "output.weight" not in regions})
    return gguf_source.stage_tensor_names(view, start, end, start == 0, end == block_count)


def gguf_block_count(names) -> int:
    """Decoder layers of a GGUF model from its tensor names (``blk.N.*``)."""
    blocks = [int(m.group(1)) for m in map(gguf_source._BLK.match, names) if m]
    return 1 + max(blocks) if blocks else 0


def gguf_stage_names(path: Path, start: int, end: int) -> tuple[list[str], dict[str, Region], int]:
    """``(names, tensor regions, block_count)`` of the stage ``[start, end)`` from the (sparse)
    GGUF file's own header.

    Raises:
        ModelFormatError: an unreadable header or one without ``block_count``.
        PlanError: a layer range outside the model.
    """
    from ringlet.daemon.errors import ModelFormatError

    header = read_gguf_header(path)
    if header.block_count is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks {header.architecture}.block_count")
    regions = {name: Region(name, offset, size) for name, offset, size in header.tensors}
    return select_gguf(regions, header.block_count, start, end), regions, header.block_count


#: ``layers.N.`` anywhere in an MLX/Hugging Face tensor name (``model.layers.3.mlp...``).
_MLX_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def select_mlx(names, num_layers: int, start: int, end: int) -> list[str]:
    """Tensors of an MLX/Hugging Face checkpoint the stage ``[start, end)`` needs: the
    ``layers.N.`` tensors of its layers; the embedding (``embed_tokens``) on the first
    stage and, when the head is tied (no ``lm_head``), on the last; the head and any other
    ``norm`` outside the layers on the last; every other tensor outside the layers on
    every stage (the stage loader drops what it does not use before reading).

    Raises:
        PlanError: a layer range outside the model.
    """
    from ringlet.daemon.engine.stage import validate_range

    validate_range(start, end, num_layers)
    first, last = start == 0, end == num_layers
    tied = not any("lm_head" in n for n in names)
    out = []
    for name in names:
        m = _MLX_LAYER.search(name)
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
