"""Byte layouts of model files: each file as named byte ranges ("regions").

The vocabulary both sides of a shard transfer share (the source's
:mod:`ringlet.daemon.shards.digests`, the receiver's :mod:`ringlet.daemon.shards.local`).
No networking here (that is :mod:`ringlet.daemon.shards.serve` and
:mod:`ringlet.daemon.shards.transfer`); everything is plain file I/O.

**Regions.** A model file is described as named byte ranges ("regions"):

* ``__header__``: the bytes before the first tensor's data. For a GGUF file that is
  the fixed header, the metadata key/values (config, tokenizer, chat template), the
  tensor infos and the padding up to ``general.alignment`` (GGUF spec:
  ``docs/gguf.md`` in ggml/llama.cpp; parsed by
  :func:`ringlet.daemon.shards.gguf_header.parse_gguf_header`, which
  finds the same offsets as the ``gguf`` package's ``GGUFReader``). For a
  ``.safetensors`` file it is the 8-byte little-endian header length N plus the N
  bytes of JSON (safetensors spec); tensor ``data_offsets`` are relative to 8 + N.
* one region per tensor, named as in the file;
* ``__file__``: a small file copied whole (``config.json``, tokenizer files).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ringlet.daemon.engine.sources import ModelLocation, read_safetensors_header
from ringlet.daemon.errors import ModelFormatError, RingletError
from ringlet.daemon.shards.gguf_header import read_gguf_header

HEADER = "__header__"
WHOLE = "__file__"
#: Default chunk size of a transfer, bytes (also the piece size of the digest cache). Measured
#: on loopback: gRPC's Python receive path costs the least CPU per byte at 0.5-1 MiB
#: messages (2 MiB and more cost twice as much).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: Files of a model directory that are copied whole (besides ``*.safetensors``).
WHOLE_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
#: Suffix of the receiver's state file, beside the sparse data file.
STATE_SUFFIX = ".shard.json"


class ShardError(RingletError):
    """A shard cannot be fetched, served or trusted; the message says which file and why."""


@dataclass(frozen=True)
class Region:
    """A named byte range of a file: ``[offset, offset + size)``, bytes."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class FileLayout:
    """One model file as regions.

    Attributes:
        rel: path relative to the model (a GGUF: its file name), ``/``-separated.
        path: the file on this machine.
        size: apparent size, bytes.
        format: ``"gguf"``, ``"safetensors"`` or ``"whole"``.
        header_bytes: bytes before the first tensor's data (0 for ``"whole"``).
        regions: header (or whole-file) region first, then tensors by offset.
        mtime_ns: the file's mtime when described (part of the digest cache key).
    """

    rel: str
    path: Path
    size: int
    format: str
    header_bytes: int
    regions: tuple[Region, ...]
    mtime_ns: int

    def region(self, name: str) -> Region:
        """The region called ``name``. Raises ``KeyError``."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}


def gguf_layout(path: Path, rel: str | None = None) -> FileLayout:
    """Regions of a GGUF file: ``__header__`` = ``[0, data section start)`` and every tensor.

    Raises:
        ModelFormatError: not a readable GGUF file, or a tensor beyond the end of the file.
    """
    st = path.stat()
    header = read_gguf_header(path)
    regions = [Region(HEADER, 0, header.header_bytes)]
    for name, offset, size in header.tensors:
        r = Region(name, offset, size)
        if r.end > st.st_size:
            raise ModelFormatError(f"{path}: truncated GGUF file: tensor {name} needs bytes up to {r.end}, "
                                   f"file has {st.st_size}")
        regions.append(r)
    return FileLayout(rel or path.name, path, st.st_size, "gguf", header.header_bytes, tuple(regions), st.st_mtime_ns)


def safetensors_layout(path: Path, rel: str) -> FileLayout:
    """Regions of a ``.safetensors`` file (header, then tensors by offset).

    Raises:
        ModelFormatError: malformed header, or a tensor beyond the end of the file.
    """
    st = path.stat()
    header_bytes, header = read_safetensors_header(path)
    regions = [Region(HEADER, 0, header_bytes)]
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name!r} has no data_offsets") from None
        r = Region(name, header_bytes + begin, end - begin)
        if begin > end or r.end > st.st_size:
            raise ModelFormatError(f"{path}: truncated safetensors file: tensor {name!r}")
        tensors.append(r)
    regions.extend(sorted(tensors, key=lambda r: r.offset))
    return FileLayout(rel, path, st.st_size, "safetensors", header_bytes, tuple(regions), st.st_mtime_ns)


def whole_layout(path: Path, rel: str) -> FileLayout:
    """A small file copied whole: one region ``__file__``."""
    st = path.stat()
    return FileLayout(rel, path, st.st_size, "whole", 0, (Region(WHOLE, 0, st.st_size),), st.st_mtime_ns)


_layouts: dict[tuple[str, int, int], FileLayout] = {}
_layouts_lock = threading.Lock()


def _cached(path: Path, rel: str, build) -> FileLayout:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _layouts_lock:
        hit = _layouts.get(key)
    if hit is not None and hit.rel == rel:
        return hit
    layout = build(path, rel)
    with _layouts_lock:
        _layouts[key] = layout
    return layout


def model_files(location: ModelLocation) -> list[FileLayout]:
    """The files a peer needs to run any stage of the model at ``location``, as layouts.

    A GGUF model is one file. An MLX/Hugging Face directory contributes its
    ``*.safetensors`` files (as header + tensors) and its small files copied whole
    (suffixes in :data:`WHOLE_FILE_SUFFIXES`, top level only; hidden files and this
    module's state files excluded). Layouts are cached per (path, size, mtime).

    Raises:
        ModelFormatError: a malformed model file.
        OSError: the files cannot be listed or read.
    """
    path = Path(location.path)
    if location.kind == "gguf":
        return [_cached(path, path.name, gguf_layout)]
    out = []
    for f in sorted(path.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name.endswith(STATE_SUFFIX):
            continue
        if f.suffix == ".safetensors":
            out.append(_cached(f, f.name, safetensors_layout))
        elif f.suffix in WHOLE_FILE_SUFFIXES:
            out.append(_cached(f, f.name, whole_layout))
    return out
