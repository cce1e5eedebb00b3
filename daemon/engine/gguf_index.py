"""A machine-wide cache of GGUF files' metadata and tensor index.

``gguf.GGUFReader`` decodes every metadata string to open a file: 3.4 s for the bundled
model's 49k-token vocabulary on this machine, paid by every daemon at every start. The
result (metadata values and each tensor's type, shape, offset and size) is saved as
JSON in the machine cache, keyed by the file's absolute path, size and modification
time, and read back in milliseconds. A missing, corrupt or other-format entry is
ignored (the file is parsed again).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a GGUF file and how to view its bytes.

    Attributes:
        name: the GGUF tensor name.
        tensor_type: its ``gguf.GGMLQuantizationType``.
        shape: its dimensions as GGUF lists them (fastest-varying first).
        n_bytes: its size in the file, bytes.
        data_offset: where it starts, bytes from the start of the file.
        data_dtype, data_shape: the numpy dtype and shape ``gguf.GGUFReader`` views its
            bytes with (``uint8`` rows of blocks for quantized types).
    """

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data_dtype: str
    data_shape: tuple[int, ...]


def cache_file(gguf_path: Path, folder: str, suffix: str = ".json") -> Path:
    """A machine-cache file for what is derived from the GGUF file at ``gguf_path``, keyed
    by its absolute path, size and modification time (so an edited file misses)."""
    from ringlet.daemon.paths import machine_cache_dir

    st = Path(gguf_path).stat()
    key = hashlib.sha256(f"{Path(gguf_path).resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return machine_cache_dir() / folder / f"{key}{suffix}"


def _plain(value: Any) -> Any:
    """Metadata values as JSON values (numpy scalars and arrays as Python ones)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value


def load(gguf_path: Path) -> tuple[dict, dict] | None:
    """``(metadata, tensors)`` saved for this file, or ``None``."""
    import gguf

    try:
        data = json.loads(cache_file(gguf_path, "gguf").read_text())
        if data.get("format") != FORMAT:
            return None
        tensors = {name: TensorInfo(name, gguf.GGMLQuantizationType(kind), tuple(shape), n_bytes, offset, dtype,
                                    tuple(data_shape))
                   for name, kind, shape, n_bytes, offset, dtype, data_shape in data["tensors"]}
        return data["metadata"], tensors
    except Exception:  # missing, corrupt, or written by another version: parse the file again
        return None


def store(gguf_path: Path, metadata: dict, tensors: dict) -> None:
    """Save ``(metadata, tensors)`` for :func:`load` (atomically; failures are ignored)."""
    body = json.dumps({"format": FORMAT, "metadata": {k: _plain(v) for k, v in metadata.items()},
                       "tensors": [[t.name, int(t.tensor_type), list(t.shape), t.n_bytes, t.data_offset,
                                    t.data_dtype, list(t.data_shape)] for t in tensors.values()]})
    from ringlet.daemon.paths import write_atomically

    write_atomically(cache_file(gguf_path, "gguf"), lambda tmp: Path(tmp).write_text(body))
