"""A model's ``config.json`` as the planner reads it: the file, the ``text_config`` overlay, the dtype.

:func:`load_config` accepts a dict, a ``config.json`` path or a model directory;
multimodal configs keep the language model's fields in ``text_config``
(:func:`text_config` overlays them); the checkpoint dtype is ``torch_dtype`` /
``dtype``, default bfloat16 (:func:`dtype_name`). :class:`ModelSpecError` is the
error of the whole config -> :class:`~ringlet.partitioning.ModelSpec` path
(:mod:`ringlet.daemon.engine.modelspec`).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ModelSpecError", "dtype_name", "load_config", "text_config"]

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}


class ModelSpecError(ValueError):
    """The config cannot be turned into a model spec (unreadable, unsupported architecture,
    missing fields). The message is one line and names the file or field."""


def load_config(source: str | Path | dict) -> tuple[dict, str, Path | None]:
    """Resolve ``source`` into (config dict, default model name, weights directory or None).

    Args:
        source: a config dict, a ``config.json`` path, or a model directory holding one.

    Raises:
        ModelSpecError: the path does not exist or is not a JSON object.
    """
    if isinstance(source, dict):
        return dict(source), str(source.get("_name_or_path") or source.get("model_type") or "model"), None
    path = Path(source).expanduser()
    if path.is_dir():
        directory, file = path, path / "config.json"
    else:
        directory, file = path.parent, path
    if not file.is_file():
        raise ModelSpecError(f"{file}: no such config file")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"{file}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"{file}: the config must be a JSON object")
    name = directory.name if file.name == "config.json" else file.stem
    has_weights = any(directory.glob("*.safetensors"))
    return config, name or "model", directory if has_weights else None


def text_config(config: dict) -> dict:
    """``config`` with its ``text_config`` fields (if any) laid over the top level."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def dtype_name(config: dict) -> str:
    """The mlx dtype name of the checkpoint's floats (``torch_dtype`` / ``dtype``, default ``"bfloat16"``)."""
    text = text_config(config)
    raw = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return _DTYPES.get(str(raw), "bfloat16") if raw else "bfloat16"
