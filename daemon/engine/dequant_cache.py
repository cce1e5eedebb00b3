"""A machine-wide cache of dequantized GGUF weights, one safetensors file per layer.

On a CPU, ``--dtype auto`` runs a quantized GGUF model dequantized to float32 (MLX's
CPU quantized matmul uses no BLAS). Dequantizing costs far more than reading: for the
bundled SmolLM2-135M (Q4_1, 98 MB -> 538 MB of float32) a whole stage loads in 1.77 s of
CPU, against 0.66 s with the float32 weights read back from safetensors files
(``bench/bench_load.py`` on this machine). Every daemon start, every re-shard that gains layers, and every tensor rank
pays it. So the result is kept:

- in the machine cache (:func:`ringlet.daemon.paths.machine_cache_dir`), under
  ``dequant/<key>/<dtype>/``, where ``key`` names the GGUF file by absolute path, size
  and modification time (an edited or replaced file misses, as for the GGUF index);
- one file per group of tensors: ``blk.N`` (a layer's tensors) or a global tensor
  (``token_embd``, ``output_norm``, ``output``), so a stage of any layer range reads
  only its own groups;
- in the layout the stage loads (q/k rows un-permuted, cast to the dtype), so a hit is
  only a read;
- within a byte budget (``--weights-cache-bytes``, default :data:`DEFAULT_BUDGET_BYTES`,
  never more than a quarter of the filesystem's free space; ``0`` turns it off). The
  least recently used files go first; a hit marks its file used;
- a key's folder records its GGUF file (``source.json``: path, size, mtime); when a new
  key is written, the folders of files that are gone or have changed since (a model
  package reinstalled, a checkout deleted) are removed at once, rather than waiting
  for the budget to push them out.

A file that cannot be read, is shorter than its header says, or lacks a tensor asked
for, is ignored and written again. Failing to write is never an error: the weights are
in memory. A write refused for want of space (ENOSPC, EDQUOT) turns the cache off for
writing in this process (:func:`off_reason` says why, naming the path, the bytes needed
and free; :func:`state` is what ``/v1/cluster`` shows as ``weights_cache``; the
:data:`on_off` callbacks are told once, so the node logs an event); files are written
through a Python file object, so a full disk is an ``OSError`` with its ``errno`` (MLX's
own writer only says "Unable to write").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx

from ringlet.daemon.errors import disk_full

log = logging.getLogger(__name__)

#: The environment variable the budget is passed in (so tensor ranks, which a daemon
#: starts, use the daemon's ``--weights-cache-bytes``).
ENV = "RINGLET_WEIGHTS_CACHE_BYTES"
#: Default budget, bytes: the float32 weights of a stage of a ~8B-parameter model.
DEFAULT_BUDGET_BYTES = 32 * 10**9
FORMAT = 1
#: The file in a key's folder that names its GGUF file.
SOURCE = "source.json"
#: Folder names of the float dtypes (the inverse of :data:`ringlet.daemon.engine.stage.DTYPES`,
#: which this module, imported by the GGUF reader that ``stage`` imports, cannot import).
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


#: Why this process stopped writing the cache (a full disk's message), or ``None``.
_off: str | None = None
_off_lock = threading.Lock()
#: Called once, with the reason, when the cache turns itself off (the node's event log).
on_off: list[Callable[[str], None]] = []


def off_reason() -> str | None:
    """Why this process no longer writes the cache, or ``None`` while it does."""
    return _off


def state() -> dict:
    """``/v1/cluster``'s ``weights_cache``: ``state`` (``"on"``, ``"off (<why>)"``, or
    ``"disabled"`` with a budget of 0), ``off`` (the reason or ``None``), ``budget_bytes``."""
    budget = budget_bytes()
    text = "disabled" if budget <= 0 else "on" if _off is None else f"off ({_off})"
    return {"state": text, "off": _off, "budget_bytes": budget}


def turn_off(reason: str) -> None:
    """Stop writing the cache in this process (reads go on), log ``reason`` and tell the
    :data:`on_off` callbacks; only the first call counts."""
    global _off
    with _off_lock:
        if _off is not None:
            return
        _off = reason
    log.warning("dequantized-weights cache off: %s", reason)
    for callback in list(on_off):
        callback(reason)


def configure(budget_bytes: int | None) -> None:
    """Set this process's budget, bytes (``None``: keep the default), inherited by the
    processes it starts."""
    if budget_bytes is not None:
        os.environ[ENV] = str(int(budget_bytes))


def budget_bytes() -> int:
    """The budget in force, bytes: ``$RINGLET_WEIGHTS_CACHE_BYTES``, else the default."""
    text = os.environ.get(ENV, "")
    return int(text) if text.isdigit() else DEFAULT_BUDGET_BYTES


def group_of(gguf_name: str) -> str:
    """The cache file a GGUF tensor belongs to: ``blk.N`` for a layer's, else its own name
    without ``.weight``."""
    if gguf_name.startswith("blk."):
        return ".".join(gguf_name.split(".")[:2])
    return gguf_name.removesuffix(".weight")


class DequantCache:
    """The cached groups of one GGUF file in one dtype.

    Args:
        gguf_path: the model file (its path, size and mtime key the cache).
        dtype: the dtype the weights are dequantized to.
    """

    def __init__(self, gguf_path: Path, dtype: mx.Dtype):
        from ringlet.daemon.engine.gguf_index import cache_file

        entry = cache_file(gguf_path, "dequant", suffix="")
        self.gguf_path = Path(gguf_path)
        self.entry = entry
        self.root = entry.parent
        self.folder = entry / f"v{FORMAT}-{_DTYPE_NAMES[dtype]}"

    @staticmethod
    def open(gguf_path: Path, dtype: mx.Dtype | None) -> DequantCache | None:
        """The cache for this file and dtype, or ``None`` when weights stay quantized
        (``dtype is None``), the dtype is not a float one, or the budget is 0."""
        if dtype not in _DTYPE_NAMES or budget_bytes() <= 0:
            return None
        return DequantCache(gguf_path, dtype)

    def held(self) -> dict[str, int]:
        """The groups cached for this file and dtype, with their files' sizes, bytes."""
        held = {}
        for path in self.folder.glob("*.safetensors"):
            with contextlib.suppress(OSError):
                held[path.name.removesuffix(".safetensors")] = path.stat().st_size
        return held

    def _file(self, group: str) -> Path:
        return self.folder / f"{group}.safetensors"

    def load(self, group: str, names: Iterable[str]) -> dict[str, mx.array] | None:
        """The arrays of ``names`` (GGUF tensor names) from the group's file, or ``None``
        when it is not cached, cannot be read, or lacks one of them."""
        path = self._file(group)
        if not whole_safetensors(path):  # missing, or cut short: dequantize again
            return None
        try:
            arrays = mx.load(str(path))
        except Exception:  # missing, cut short or corrupt: dequantize again
            return None
        wanted = list(names)
        if not set(wanted) <= set(arrays):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return {name: arrays[name] for name in wanted}

    def store(self, group: str, arrays: dict[str, mx.array]) -> None:
        """Save a whole group (atomically), then evict the least recently used files beyond the
        budget. Never raises: a cache that cannot be written is only slower."""
        from ringlet.daemon.paths import write_atomically

        if _off is not None:
            return
        size = sum(a.nbytes for a in arrays.values())
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            limit = min(budget_bytes(), shutil.disk_usage(self.folder).free // 4)
        except OSError:
            return
        if size > limit:
            return

        def write(tmp: str) -> None:
            # through a file object: a full disk raises OSError(ENOSPC), where MLX's own
            # writer raises a RuntimeError without the errno
            with open(tmp, "wb") as f:
                mx.save_safetensors(f, arrays, metadata={"format": str(FORMAT)})
            if not whole_safetensors(Path(tmp)):
                raise OSError(f"{tmp}: shorter than its safetensors header says")

        try:
            error = write_atomically(self._file(group), write)
        except Exception as exc:  # MLX's own errors: the weights are in memory, only not cached
            error = exc
        if error is not None:
            full = disk_full(error, self._file(group), size, "the dequantized-weights cache")
            if full is not None:
                turn_off(str(full))
            else:
                log.debug("cannot cache dequantized weights %s: %s", group, error)
            return
        if not (self.entry / SOURCE).is_file():
            self._record_source()
            self._sweep_stale()
        self._evict(limit)

    def _record_source(self) -> None:
        from ringlet.daemon.paths import write_atomically

        try:
            st = self.gguf_path.stat()
        except OSError:
            return
        record = {"path": str(self.gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        write_atomically(self.entry / SOURCE, lambda tmp: Path(tmp).write_text(json.dumps(record)))

    def _sweep_stale(self) -> None:
        """Remove every other key's folder whose recorded GGUF file is gone or changed.
        Folders without a record (older ringlet) are left to the budget."""
        for folder in self.root.iterdir():
            if folder == self.entry or not folder.is_dir():
                continue
            try:
                record = json.loads((folder / SOURCE).read_text())
                path, size, mtime_ns = Path(record["path"]), int(record["size"]), int(record["mtime_ns"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            try:
                st = path.stat()
                stale = (st.st_size, st.st_mtime_ns) != (size, mtime_ns)
            except FileNotFoundError:
                stale = True
            except OSError:
                continue
            if stale:
                log.info("removing dequantized weights of %s (the file is gone or changed)", path)
                shutil.rmtree(folder, ignore_errors=True)

    def _evict(self, limit: int) -> None:
        """Delete the least recently used files of every cached model until the cache
        holds at most ``limit`` bytes."""
        files = []
        for path in self.root.glob("*/*/*.safetensors"):
            with contextlib.suppress(OSError):
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= limit:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size


def whole_safetensors(path: Path) -> bool:
    """Whether ``path`` is as long as its safetensors header says (8-byte header length,
    the JSON header, then every tensor's bytes): a file cut short by a full disk or a
    crash is never read as whole. Reads only the header."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100 * 2**20:
                return False
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            return os.fstat(f.fileno()).st_size >= 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
