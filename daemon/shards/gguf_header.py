"""A fast GGUF header parser: the tensor regions and the few metadata values a shard
transfer needs, read without decoding the tokenizer (GGUF spec: ``docs/gguf.md`` in
ggml/llama.cpp; the offsets are those the ``gguf`` package's ``GGUFReader`` finds).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ringlet.daemon.errors import ModelFormatError

#: Byte size of the scalar GGUF value types (GGUF spec, ``GGUFValueType`` in the gguf package).
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`parse_gguf_header` reads: tensor regions and the few metadata values a
    transfer needs.

    Attributes:
        header_bytes: where the data section starts (bytes; aligned to ``general.alignment``).
        tensors: ``(name, offset, n_bytes)`` by offset, offsets absolute in the file.
        block_count: ``<arch>.block_count`` (decoder layers), or ``None``.
        architecture: ``general.architecture``.
    """

    header_bytes: int
    tensors: tuple[tuple[str, int, int], ...]
    block_count: int | None
    architecture: str | None


def _skip(view: memoryview, kind: int, pos: int, keep: bool) -> tuple[int, object]:
    """Step over one GGUF value of type ``kind`` at ``pos``: ``(next pos, value if keep)``."""
    unpack = struct.unpack_from
    if kind in _GGUF_SCALARS:
        size = _GGUF_SCALARS[kind]
        value = unpack({1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size], view, pos)[0] if keep else None
        return pos + size, value
    if kind == _GGUF_STRING:
        (n,) = unpack("<Q", view, pos)
        value = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8", "replace") if keep else None
        return pos + 8 + n, value
    if kind == _GGUF_ARRAY:
        sub, count = unpack("<IQ", view, pos)
        pos += 12
        if sub in _GGUF_SCALARS:
            return pos + count * _GGUF_SCALARS[sub], None
        if sub == _GGUF_STRING:  # the tokenizer's vocabulary and merges: the hot loop
            length = _U64.unpack_from
            for _ in range(count):
                pos += 8 + length(view, pos)[0]
            return pos, None
        for _ in range(count):
            pos, _value = _skip(view, sub, pos, False)
        return pos, None
    raise ModelFormatError(f"unknown GGUF value type {kind}")


def parse_gguf_header(buf) -> GGUFHeader:
    """Parse a GGUF header (versions 2 and 3) from ``buf`` (bytes, mmap or memoryview of the
    file's first bytes), skipping metadata values it does not need.

    Layout (GGUF spec, ggml ``docs/gguf.md``; as the gguf package's ``GGUFReader`` reads
    it): magic ``GGUF``, uint32 version, uint64 tensor count, uint64 key/value count; each
    key/value: string key, uint32 type, value (strings: uint64 length + UTF-8; arrays:
    uint32 element type, uint64 count, elements); each tensor info: string name, uint32
    n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset relative to the data
    section; then zero padding to ``general.alignment`` (default 32). A tensor's bytes are
    ``elements / block_size * type_size`` (``gguf.constants.GGML_QUANT_SIZES``).

    This is ~100x faster than ``GGUFReader`` on a file with a large vocabulary, which
    decodes every tokenizer string into its own array.

    Raises:
        ModelFormatError: not GGUF, an unsupported version or type, or ``buf`` too short.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    view = memoryview(buf)
    unpack = struct.unpack_from
    try:
        if bytes(view[:4]) != b"GGUF":
            raise ModelFormatError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = unpack("<IQQ", view, 4)
        if version not in (2, 3):
            raise ModelFormatError(f"GGUF version {version} is not supported")
        pos = 24
        meta: dict[str, object] = {}

        for _ in range(n_kv):
            (n,) = unpack("<Q", view, pos)
            key = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8", "replace")
            pos += 8 + n
            (kind,) = unpack("<I", view, pos)
            keep = key in ("general.architecture", "general.alignment") or key.endswith(".block_count")
            pos, value = _skip(view, kind, pos + 4, keep)
            if keep:
                meta[key] = value
        infos = []
        for _ in range(n_tensors):
            (n,) = unpack("<Q", view, pos)
            name = bytes(view[pos + 8: pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            (n_dims,) = unpack("<I", view, pos)
            dims = unpack(f"<{n_dims}Q", view, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, rel = unpack("<IQ", view, pos)
            pos += 12
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            elements = 1
            for d in dims:
                elements *= d
            infos.append((name, rel, elements // block * type_size))
    except (struct.error, ValueError, KeyError) as exc:
        raise ModelFormatError(f"malformed or truncated GGUF header ({type(exc).__name__}: {exc})") from None
    finally:
        view.release()
    alignment = int(meta.get("general.alignment") or 32)
    data_start = pos + (-pos % alignment)
    arch = meta.get("general.architecture")
    blocks = meta.get(f"{arch}.block_count")
    tensors = tuple(sorted(((name, data_start + rel, size) for name, rel, size in infos), key=lambda t: t[1]))
    return GGUFHeader(data_start if tensors else len(view), tensors, int(blocks) if blocks is not None else None,
                      arch if isinstance(arch, str) else None)


def read_gguf_header(path: Path) -> GGUFHeader:
    """:func:`parse_gguf_header` on a file (memory-mapped; only the header pages are read).

    Raises:
        ModelFormatError: not a readable GGUF file (the message names it).
    """
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return parse_gguf_header(mm)
            except ModelFormatError as exc:
                raise ModelFormatError(f"{path}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc}") from None
