"""An optimized BLAS under MLX's CPU backend, loaded by ringlet itself (Linux).

The ``mlx-cpu`` wheel links ``libmlx.so`` against the netlib reference BLAS it
bundles (``mlx_cpu.libs/libblas-*.so.3.10.0``): float32 matmul runs at about
5 GFLOP/s whatever its size. MLX's CPU matmul calls ``cblas_sgemm`` (and
``cblas_dgemm``, ``cblas_cgemm``; ``nm -D libmlx.so``). A library loaded into the
process's *global* symbol scope before ``mlx.core`` is imported supplies those
symbols instead (the dynamic linker searches the global scope before a library's
own dependencies), so MLX runs on it unchanged. Debian's OpenBLAS
(``libopenblas0-pthread``) measures 115-173 GFLOP/s here for 64-1024 rows.

:func:`load` does that, once per process, before MLX:

1. pick the library: ``RINGLET_BLAS=/path/to/lib.so`` (``none`` turns it off), else
   the system OpenBLAS found through the loader cache (``libopenblas.so.0``);
2. load it privately (``RTLD_LOCAL``) and check one small ``cblas_sgemm`` against
   numpy's own matmul; a missing file, missing symbol or wrong result falls back to
   the bundled BLAS with one warning line;
3. put :mod:`~ringlet.daemon.probes.gemv_forward` in front of it, so that matrix-vector
   products (a decode step's matmuls) run through its ``sgemv`` (about 2x faster);
4. size its threads (``openblas_set_num_threads``) and promote it to the global
   scope (``RTLD_GLOBAL``), so that ``libmlx.so`` binds to it when MLX loads.

``OPENBLAS_CORETYPE`` in the environment is honoured by OpenBLAS itself and never
changed here. :func:`report` says what is in use (for ``/v1/cluster``, ``status``
and ``doctor``); :func:`mapped_blas_libraries` reads ``/proc/self/maps`` to show
which BLAS the running process has mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ringlet.daemon.probes import gemv_forward

log = logging.getLogger("ringlet.daemon.probes")

ENV = "RINGLET_BLAS"
THREADS_ENV = "RINGLET_THREADS"
#: The Debian/Ubuntu package that provides the default library.
PACKAGE = "libopenblas0-pthread"
FIX = f"apt-get install {PACKAGE} (or set {ENV}=/path/to/libopenblas.so)"
# cblas enum values (cblas.h): row-major, no transpose.
_ROW_MAJOR, _NO_TRANS = 101, 111


@dataclass(frozen=True)
class BlasReport:
    """The BLAS MLX's CPU backend uses in this process.

    Attributes:
        kind: ``optimized`` (a library ringlet loaded and checked), ``bundled`` (MLX's
            reference BLAS), or ``platform`` (macOS: MLX uses Accelerate / Metal).
        library: path of the loaded library, if any.
        threads: the library's thread count, if it reports one.
        reason: why ``bundled`` is in use (``None`` otherwise).
        fix: what to do about a slow path (``None`` when there is nothing to fix).
        coretype: ``OPENBLAS_CORETYPE`` as found in the environment (never changed).
        gemv_forward: path of the library that sends M == 1 / N == 1 products to the
            BLAS's ``sgemv`` (:mod:`~ringlet.daemon.probes.gemv_forward`), when in use.
        gemv_reason: why that is not in use (``None`` when it is, or with no optimized BLAS).
        gemv_fix: what to do about that (``None`` when nothing is to be done).
    """

    kind: str
    library: str | None = None
    threads: int | None = None
    reason: str | None = None
    fix: str | None = None
    coretype: str | None = None
    gemv_forward: str | None = None
    gemv_reason: str | None = None
    gemv_fix: str | None = None

    def to_dict(self) -> dict:
        """JSON-safe form (``/v1/cluster``'s ``blas``)."""
        return asdict(self)


_report: BlasReport | None = None
_lib: ctypes.CDLL | None = None


def default_threads(daemons_on_machine: int | None = None) -> int:
    """Threads for one process: the cores this process may use (its CPU affinity) divided
    by the ringlet processes sharing the machine when known, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, daemons_on_machine or 1))


def _resolve(choice: str | None) -> tuple[str | None, str | None]:
    """(library to load, reason there is none)."""
    if choice is not None and choice.strip().lower() == "none":
        return None, f"{ENV}=none"
    if choice:
        if not Path(choice).is_file():
            return None, f"{ENV}={choice}: no such file"
        return choice, None
    found = ctypes.util.find_library("openblas")
    if not found:
        return None, "no OpenBLAS in the loader cache"
    return found, None


def _check_gemm(lib: ctypes.CDLL) -> str | None:
    """Multiply two small random float32 matrices with ``lib``'s ``cblas_sgemm`` and
    compare with numpy's matmul (float64 reference). ``None`` when they agree."""
    import numpy as np

    try:
        sgemm = lib.cblas_sgemm
    except AttributeError:
        return "it has no cblas_sgemm"
    m, k, n = 7, 33, 5
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.zeros((m, n), dtype=np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    sgemm.restype = None
    sgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_float, ptr, ctypes.c_int, ptr, ctypes.c_int, ctypes.c_float, ptr, ctypes.c_int]
    sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data_as(ptr), k, b.ctypes.data_as(ptr), n,
          0.0, c.ctypes.data_as(ptr), n)
    want = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(c - want)))
    if not np.isfinite(err) or err > 1e-3:
        return f"its sgemm is wrong (max abs error {err:.3g})"
    return None


def set_threads(n: int) -> int | None:
    """Set the loaded library's thread count (``openblas_set_num_threads``); returns the
    count in force, or ``None`` when no optimized library is loaded or it has no such call."""
    global _report
    if _lib is None or not hasattr(_lib, "openblas_set_num_threads"):
        return None
    _lib.openblas_set_num_threads(ctypes.c_int(max(1, int(n))))
    threads = _lib.openblas_get_num_threads() if hasattr(_lib, "openblas_get_num_threads") else max(1, int(n))
    gemv_forward.set_threads(threads)
    if _report is not None:
        _report = BlasReport(**{**_report.to_dict(), "threads": int(threads)})
    return int(threads)


def load(threads: int | None = None, *, warn=None) -> BlasReport:
    """Load and check the optimized BLAS before MLX (once per process; later calls
    return the first report and only resize the threads).

    Args:
        threads: the library's thread count; ``None``: ``$RINGLET_THREADS``, else
            :func:`default_threads`.
        warn: called with the one-line warning of a fallback (default: the log).

    Never raises: every failure falls back to MLX's bundled BLAS, says why once,
    and the process goes on.
    """
    global _report, _lib
    if threads is None and os.environ.get(THREADS_ENV, "").isdigit():
        threads = int(os.environ[THREADS_ENV])
    if _report is not None:
        if threads is not None:
            set_threads(threads)
        return _report
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    if sys.platform != "linux":
        _report = BlasReport(kind="platform", coretype=coretype)
        return _report
    path, reason = _resolve(os.environ.get(ENV))
    lib = None
    if path is not None and "mlx.core" in sys.modules:
        reason = "mlx.core was imported before ringlet could load it"
    elif path is not None:
        try:
            lib = ctypes.CDLL(path)  # RTLD_LOCAL: nothing binds to it until it passes the check
        except OSError as exc:
            reason = f"cannot load {path}: {str(exc).splitlines()[0]}"
        else:
            reason = _check_gemm(lib)
            reason = f"{path}: {reason}" if reason else None
    if reason is not None or lib is None:
        explicit_off = reason == f"{ENV}=none"
        fix = f"unset {ENV} (=none turns the optimized BLAS off)" if explicit_off else FIX
        _report = BlasReport(kind="bundled", reason=reason, fix=fix, coretype=coretype)
        if not explicit_off:
            (warn or log.warning)(f"ringlet: MLX uses its bundled reference BLAS ({reason}); "
                                  f"CPU matmuls run ~30x slower. Fix: {FIX}")
        return _report
    forward, forward_reason = gemv_forward.install(lib)  # global before the BLAS: libmlx binds its sgemm
    forward_fix = gemv_forward.fix_for(forward_reason)
    if forward_reason is not None and not gemv_forward.disabled():
        (warn or log.warning)(f"ringlet: decode matmuls run through sgemm, ~2x slower than sgemv ({forward_reason})"
                              + (f". Fix: {forward_fix}" if forward_fix else ""))
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # promote: libmlx.so binds cblas_* to it
    _lib = lib
    _report = BlasReport(kind="optimized", library=_library_path(path), coretype=coretype,
                         gemv_forward=str(forward) if forward else None, gemv_reason=forward_reason,
                         gemv_fix=forward_fix)
    set_threads(threads if threads is not None else default_threads())
    return _report


def report() -> BlasReport:
    """What :func:`load` decided; ``bundled`` with a reason when it never ran."""
    if _report is not None:
        return _report
    if sys.platform != "linux":
        return BlasReport(kind="platform", coretype=os.environ.get("OPENBLAS_CORETYPE"))
    return BlasReport(kind="bundled", reason="ringlet did not load a BLAS in this process", fix=FIX,
                      coretype=os.environ.get("OPENBLAS_CORETYPE"))


def mapped_blas_libraries(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the BLAS libraries mapped into this process (Linux), sorted: the bundled
    ``libblas-*.so`` is always there with MLX; an optimized one is there when loaded."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    found = {line.split()[-1] for line in text.splitlines()
             if len(line.split()) >= 6 and "blas" in Path(line.split()[-1]).name.lower()}
    return sorted(found)


def _library_path(name: str) -> str:
    """The file behind ``name`` (a soname like ``libopenblas.so.0`` resolves through the maps)."""
    if os.path.isabs(name):
        return os.path.realpath(name)
    for path in mapped_blas_libraries():
        if Path(path).name.startswith(name.split(".so")[0]):
            return path
    return name
