"""Matrix-vector products through ``sgemv``: a decode step's matmuls at memory speed.

MLX's CPU backend computes every float32 matmul with ``cblas_sgemm``, a decode step's
``(1, K) @ (K, N)`` products too. OpenBLAS 0.3.21 (Debian 12's) packs the whole weight
matrix for such a call: 9.1 GB/s here on 60 different 576 x 1536
float32 weights (2 threads), where its ``cblas_sgemv`` streams the same weights at
20.3 GB/s; one decode step of SmolLM2-135M in float32 took 65 ms, 44 ms with the products
forwarded (see ``bench/bench_blas.py``). Newer OpenBLAS forwards these calls itself on
some architectures (OpenBLAS PR #4814, ``GEMM_GEMV_FORWARD``).

``gemv_forward.c`` (beside this file) is a tiny library that exports ``cblas_sgemm``
only: calls with M == 1 or N == 1 (and K > 0) go to the real ``cblas_sgemv``, every
other call to the real ``cblas_sgemm``, except products of 2 to 8 rows: those go to
its own kernel, which reads each weight row once for all of them (OpenBLAS's sgemm packs
the whole weight again for every such call: a 7-position forward, a speculative step's
verification, cost 2.3-2.6 single-position ones). :func:`install` builds it once per machine
with the C compiler (``$CC``, else ``cc``/``gcc``/``clang``; :data:`VARIANTS`), caches it in
the machine cache, loads it into the global symbol scope *before* the checked BLAS is
promoted there (so ``libmlx.so`` binds ``cblas_sgemm`` to it), binds the BLAS's own
two functions, and checks every transpose and order of the products :data:`CHECKED`
(one row, one column, a few rows) against numpy (float64). Any failure leaves the calls
going straight to the BLAS's sgemm, with the reason. ``RINGLET_GEMV_FORWARD=0`` turns it off; ``RINGLET_FEW_ROWS=0``
sends the few-row products back to sgemm (for benchmarks).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import shutil
import subprocess
from pathlib import Path

from ringlet.daemon.paths import machine_cache_dir, write_atomically

ENV = "RINGLET_GEMV_FORWARD"
#: ``0`` sends products of a few rows to the BLAS's sgemm, as before the kernel
FEW_ROWS_ENV = "RINGLET_FEW_ROWS"
SOURCE = Path(__file__).with_name("gemv_forward.c")
#: What makes the build possible where it is not (Debian/Ubuntu).
FIX = "apt-get install gcc (ringlet builds a 2 kB library once, to run decode matmuls through sgemv)"
#: The reason :func:`build` gives when no compiler is found: the one :data:`FIX` fixes.
NO_COMPILER = "no C compiler (cc, gcc or clang) to build it"
_BUILD_TIMEOUT_S = 60.0
#: Flags of every build; no loop is turned into a memset call (the library may be built
#: without libc).
CFLAGS = ("-O3", "-shared", "-fPIC", "-fno-tree-loop-distribute-patterns")
#: The builds tried, best first: for this CPU (the few-row kernel's vectors then use
#: AVX2/AVX-512 or NEON) and with OpenMP (its rows shared by the BLAS's thread count);
#: without OpenMP, no libc is linked (the library calls only the two pointers it is
#: bound to), so no stack protector either (its failure handler is libc's).
_NO_LIBC = ("-nostdlib", "-fno-stack-protector")
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native", *_NO_LIBC), _NO_LIBC)
# cblas enum values (cblas.h)
_ROW, _COL, _NT, _T = 101, 102, 111, 112
_FLOAT_P = ctypes.POINTER(ctypes.c_float)
_SGEMM_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, _FLOAT_P, ctypes.c_int, _FLOAT_P, ctypes.c_int,
                                    ctypes.c_float, _FLOAT_P, ctypes.c_int]


def disabled(name: str = ENV) -> bool:
    """The environment variable ``name`` (default ``RINGLET_GEMV_FORWARD``) is
    ``0``/``off``/``no``/``false``."""
    return os.environ.get(name, "").strip().lower() in {"0", "off", "no", "false"}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cache_dir: Path | None = None) -> tuple[Path | None, str | None]:
    """The built library (compiled once per source version into ``cache_dir``, default
    the machine cache's ``blas/``), or ``(None, reason)`` when it cannot be built.

    Concurrent processes may build at once: each writes its own temporary file and moves
    it into place in one step (:func:`~ringlet.daemon.paths.write_atomically`).
    """
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"cannot read {SOURCE}: {exc.strerror}"
    key = hashlib.sha256(source + repr((CFLAGS, VARIANTS)).encode()).hexdigest()[:16]
    name = f"ringlet-blas-gemv-{key}.so"  # "blas" in the name: listed among the mapped BLAS
    target = (cache_dir or machine_cache_dir() / "blas") / name
    if target.is_file():
        return target, None
    cc = _compiler()
    if cc is None:
        return None, NO_COMPILER
    failure: list[str] = []

    def compile_to(tmp: str) -> None:
        for variant in VARIANTS:  # the first the compiler builds
            argv = [cc, *CFLAGS, *variant, "-o", tmp, str(SOURCE)]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)  # noqa: S603
            if run.returncode == 0:
                return
        failure.append((run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1])
        raise ValueError("build failed")

    try:
        error = write_atomically(target, compile_to)
    except subprocess.TimeoutExpired:
        return None, f"{cc} took over {_BUILD_TIMEOUT_S:.0f} s"
    if error is not None:
        return None, f"{cc} could not build it: {failure[0] if failure else error}"
    return target, None


#: (M, K, N) of the products :func:`_check` computes: one row, one column, few rows
#: (K not a multiple of the vector width), few columns, and ordinary products
CHECKED = ((1, 37, 9), (9, 37, 1), (1, 5, 1), (2, 37, 9), (7, 67, 5), (8, 16, 3), (5, 9, 2), (3, 6, 4),
           (9, 8, 12), (4, 3, 600))


def _check(sgemm) -> str | None:
    """Every transpose, both orders, of the products :data:`CHECKED` through ``sgemm``,
    against numpy's float64 matmul; ``None`` when all agree."""
    import numpy as np

    rng = np.random.default_rng(1)
    sgemm.restype, sgemm.argtypes = None, _SGEMM_ARGS
    for (m, k, n), ta, tb, beta in itertools.product(CHECKED, (False, True), (False, True), (2.0, 0.0)):
        a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        # beta == 0: C must not be read (BLAS's rule), so it starts as NaN
        c0 = rng.standard_normal((m, n)).astype(np.float32) if beta else np.full((m, n), np.nan, np.float32)
        want = 0.5 * (a.T if ta else a).astype(np.float64) @ (b.T if tb else b) + (beta * c0 if beta else 0.0)
        for order in (_ROW, _COL):
            # a column-major matrix is the row-major array of its transpose
            aa, bb, c = (a, b, c0.copy()) if order == _ROW else (
                np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), np.ascontiguousarray(c0.T))
            ld = (aa.shape[1], bb.shape[1], c.shape[1])
            sgemm(order, _T if ta else _NT, _T if tb else _NT, m, n, k, 0.5, aa.ctypes.data_as(_FLOAT_P),
                  ld[0], bb.ctypes.data_as(_FLOAT_P), ld[1], beta, c.ctypes.data_as(_FLOAT_P), ld[2])
            got = c if order == _ROW else c.T
            err = float(np.max(np.abs(got - want)))
            if not np.isfinite(err) or err > 1e-3:
                layout = "row" if order == _ROW else "column"
                return (f"a {m}x{k}x{n} {layout}-major product (transposes {ta}, {tb}, beta {beta}) is wrong "
                        f"(max abs error {err:.3g})")
    return None


def fix_for(reason: str | None) -> str | None:
    """What to do about a reason :func:`install` gave: :data:`FIX` when the machine has no
    compiler, else ``None`` (turned off on purpose, or nothing a user can install fixes)."""
    return FIX if reason == NO_COMPILER else None


def install(blas: ctypes.CDLL) -> tuple[Path | None, str | None]:
    """Put the forwarding ``cblas_sgemm`` in front of ``blas`` (loaded ``RTLD_LOCAL`` and
    checked, not yet global). Call it before ``blas`` is promoted to the global scope and
    before ``mlx.core`` is imported.

    Returns ``(library path, None)`` when forwarding is in use, else ``(None, reason)``;
    never raises. A library that fails its check stays loaded but forwards nothing.
    """
    if disabled():
        return None, f"{ENV}=0"
    try:
        real_gemm, real_gemv = blas.cblas_sgemm, blas.cblas_sgemv
    except AttributeError:
        return None, "the BLAS has no cblas_sgemv"
    path, reason = build()
    if path is None:
        return None, reason
    try:
        shim = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        bind = shim.ringlet_gemv_forward_bind
    except (OSError, AttributeError) as exc:
        return None, f"cannot load {path}: {str(exc).splitlines()[0]}"
    bind.restype, bind.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    gemm_p, gemv_p = ctypes.cast(real_gemm, ctypes.c_void_p), ctypes.cast(real_gemv, ctypes.c_void_p)
    bind(gemm_p, gemv_p, 1)
    reason = _check(shim.cblas_sgemm)
    if reason is not None:
        bind(gemm_p, None, 0)  # everything straight to the real sgemm
        return None, f"{path}: {reason}"
    if disabled(FEW_ROWS_ENV):
        bind(gemm_p, gemv_p, 0)
    global _shim
    _shim = shim
    return path, None


_shim: ctypes.CDLL | None = None


def set_threads(n: int) -> None:
    """Share the few-row kernel's work among ``n`` threads (the BLAS's own count: a
    single-row product runs on them through ``sgemv``); no-op when it is not loaded."""
    if _shim is not None and hasattr(_shim, "ringlet_few_rows_threads"):
        _shim.ringlet_few_rows_threads(ctypes.c_int(max(1, int(n))))
