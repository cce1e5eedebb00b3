"""Model directories that hold only some of their checkpoint's safetensors files.

A node that downloads only its own layers from the Hugging Face Hub
(:mod:`ringlet.daemon.shards.hub_fetch`) has a snapshot directory with ``config.json``,
the tokenizer, ``model.safetensors.index.json`` and just the files its stage needs.
Two things must still work there, exactly as on a full directory:

* **sizing and planning** (:func:`build_partial_model`): the whole model built lazily
  with every parameter's final shape, dtype and quantization, as mlx-lm's
  ``load_model`` would build it. The tensors of the files that are not here come from a
  *headers file* (:func:`write_headers_file`: every safetensors header of the
  checkpoint, read from the Hub with range requests before any weight arrives);
  placeholders (lazy zeros, never evaluated) stand in for the weights, so the
  loader's own rules (``sanitize``, "quantized iff the checkpoint has scales") decide.
  A module no header describes keeps the config's dtype, unquantized.
* **loading a stage** (:func:`check_stage_present`): mlx-lm loads the files present
  (``strict=False``), and before anything is evaluated every parameter the stage keeps
  must have come from them (strict for the stage); a tensor of the stage in an absent
  file is an error naming it and its file, never a random weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.errors import ModelFormatError

INDEX_FILE = "model.safetensors.index.json"
#: Version of the headers file format (another version is ignored).
HEADERS_FORMAT = 1


def weight_map(directory: Path) -> dict[str, str] | None:
    """``weight_map`` (tensor name -> file name) of the directory's
    ``model.safetensors.index.json``, or ``None`` without one.

    Raises:
        ModelFormatError: the index is unreadable or has no ``weight_map`` object.
    """
    path = Path(directory) / INDEX_FILE
    if not path.exists():
        return None
    try:
        mapping = json.loads(path.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelFormatError(f"{path}: unreadable index: {exc}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ModelFormatError(f"{path}: the index has no weight_map of tensor names to files")
    return mapping


def absent_files(location: ModelLocation) -> list[str]:
    """Files the index names that are not in the directory (a dangling link counts as
    absent), sorted; ``[]`` for a GGUF file or a directory without an index."""
    if location.kind != "mlx":
        return []
    mapping = weight_map(Path(location.path)) or {}
    return sorted(f for f in set(mapping.values()) if not (Path(location.path) / f).is_file())


def write_headers_file(path: Path, files: dict[str, dict], **extra: Any) -> None:
    """Write a headers file: ``files`` maps each safetensors file name to
    ``{"size": bytes, "sha256": hex or None, "tensors": {name: {"dtype", "shape",
    "data_offsets"}}}`` (``dtype`` as in safetensors headers, ``"F32"``, ``"BF16"``…);
    ``extra`` keys (repository, revision, weight map) are stored beside them. Written
    atomically.

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": HEADERS_FORMAT, **extra, "files": files}, sort_keys=True))
    tmp.replace(path)


def read_headers_file(path: Path | None) -> dict | None:
    """A headers file written by :func:`write_headers_file`, or ``None`` when there is
    none, it is unreadable or of another format."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != HEADERS_FORMAT or not isinstance(data.get("files"), dict):
        return None
    return data


def _known_tensors(location: ModelLocation) -> dict[str, dict]:
    """Tensor name -> header entry of every tensor described: the safetensors files in
    the directory (their own headers) and, for the others, the headers file."""
    from ringlet.daemon.engine.sources import read_safetensors_header

    directory = Path(location.path)
    tensors: dict[str, dict] = {}
    sidecar = read_headers_file(location.headers)
    if sidecar is not None:
        for info in sidecar["files"].values():
            tensors.update(info.get("tensors") or {})
    for file in sorted(directory.glob("*.safetensors")):
        if file.is_file():
            _, header = read_safetensors_header(file)
            tensors.update({k: v for k, v in header.items() if k != "__metadata__"})
    return tensors


def build_partial_model(location: ModelLocation) -> tuple[Any, dict]:
    """The whole model of a partial directory, built lazily as ``mlx_lm.utils.load_model``
    builds it (config, class, ``sanitize``, quantization by the checkpoint's scales,
    weights), with placeholders for the weights: for sizing and planning. Nothing is
    read but headers; nothing is allocated.

    Raises:
        ModelFormatError: an unreadable config or header, or an architecture mlx-lm lacks.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, load_config

    from ringlet.daemon.engine.lazy_model import _ST_DTYPES, cast_parameters, quantize
    from ringlet.daemon.engine.model_config import ModelSpecError, dtype_name

    directory = Path(location.path)
    try:
        config = load_config(directory)
        text = config.get("text_config") or {}
        if "quantization_config" not in config and isinstance(text, dict) and "quantization_config" in text:
            config["quantization_config"] = text["quantization_config"]
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFormatError(f"{directory}: cannot build the model: {exc}") from None
    cast_parameters(model, getattr(mx, dtype_name(config)))
    weights = {name: mx.zeros(tuple(info.get("shape", ())), dtype=getattr(mx, _ST_DTYPES.get(str(info.get("dtype")),
                                                                                             "uint8")))
               for name, info in _known_tensors(location).items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        quantize(model, config, weights, nn)
    except ModelSpecError as exc:
        raise ModelFormatError(f"{directory}: {exc}") from None
    model.load_weights(list(weights.items()), strict=False)
    model.eval()
    return model, config


def check_stage_present(model: Any, location: ModelLocation, start: int, end: int) -> None:
    """Check, before anything is evaluated, that every parameter the stage ``[start, end)``
    keeps of ``model`` (built by mlx-lm from the files present, not yet pruned) has a
    tensor in those files.

    Raises:
        ModelFormatError: a tensor of the stage is in a file that is not here; the message
            names it, its file and how many more are missing.
    """
    from mlx.utils import tree_flatten

    from ringlet.daemon.engine.lazy_model import placeholder_weights
    from ringlet.daemon.engine.stage_tensors import select_mlx

    directory = Path(location.path)
    present = placeholder_weights(directory, model) or {}
    names = [k for k, _ in tree_flatten(model.parameters())]
    lacking = [n for n in select_mlx(names, len(model.layers), start, end) if n not in present]
    if lacking:
        where = (weight_map(directory) or {}).get(lacking[0])
        raise ModelFormatError(
            f"{directory}: layers [{start}, {end}) need {len(lacking)} tensor(s) that are not on this machine, "
            f"e.g. {lacking[0]}" + (f" (in {where}, not downloaded)" if where else ""))
