"""Which tensors a stage ``[start, end)`` needs, by name: the rule for GGUF files
(:func:`select_gguf`, the loader's own rule) and for MLX/Hugging Face checkpoints
(:func:`select_mlx`, from :mod:`ringlet.daemon.engine.stage_tensors`). No I/O beyond
reading a local GGUF header.
"""

from __future__ import annotations

from pathlib import Path

from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.stage_tensors import select_mlx
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


__all__ = ["gguf_block_count", "gguf_stage_names", "select_gguf", "select_mlx"]
