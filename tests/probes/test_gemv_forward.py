"""Matrix-vector products through the BLAS's sgemv (daemon/probes/gemv_forward.py), on
real processes: the real dynamic linker's bindings (``LD_DEBUG=bindings``), the real
OpenBLAS and MLX. Expected values come from numpy's float64 matmul; which library
``libmlx.so`` calls comes from the loader's own trace, not from ringlet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet.daemon.probes import gemv_forward

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS loader is for Linux CPUs")
needs_openblas = pytest.mark.skipif(ctypes.util.find_library("openblas") is None,
                                    reason="no system OpenBLAS (make install brings it as root)")

# Products a decode step makes (1 row), their transposes, N == 1, a batch, addmm's alpha
# and beta, products of a few rows (a verifying step's, a decode group's: the few-row
# kernel), and an ordinary product that must still go to sgemm.
PRODUCTS = r"""
import json, sys
import numpy as np
from ringlet.daemon.probes import blas
report = blas.load()
import ctypes
# products the few-row kernel computed (its own load-time check included: counted from here)
counter = ctypes.c_ulong.in_dll(ctypes.CDLL(report.gemv_forward), "ringlet_few_rows_calls") \
    if report.gemv_forward else None
few_before = counter.value if counter is not None else 0
import mlx.core as mx
rng = np.random.default_rng(7)
def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)
errs = {}
x, w = f32(1, 576), f32(1536, 576)
errs["x @ W.T"] = (np.array(mx.array(x) @ mx.array(w).T), x.astype(np.float64) @ w.T)
xt = f32(576, 1)
errs["xt.T @ W.T"] = (np.array(mx.array(xt).T @ mx.array(w).T), xt.T.astype(np.float64) @ w.T)
v = f32(576, 1)
errs["W @ v"] = (np.array(mx.array(w) @ mx.array(v)), w.astype(np.float64) @ v)
wt = f32(576, 64)
errs["Wt.T @ v"] = (np.array(mx.array(wt).T @ mx.array(v)), wt.T.astype(np.float64) @ v)
xb = f32(3, 1, 576)
errs["batch"] = (np.array(mx.array(xb) @ mx.array(w).T), xb.astype(np.float64) @ w.T)
c = f32(1, 1536)
errs["addmm"] = (np.array(mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0)),
                 2.0 * c.astype(np.float64) + 0.5 * (x.astype(np.float64) @ w.T))
x4 = f32(4, 576)
errs["4 rows @ W.T"] = (np.array(mx.array(x4) @ mx.array(w).T), x4.astype(np.float64) @ w.T)
s7, v7 = f32(7, 300), f32(300, 64)
errs["7 rows @ V"] = (np.array(mx.array(s7) @ mx.array(v7)), s7.astype(np.float64) @ v7)
c3 = f32(3, 1536)
errs["addmm 3 rows"] = (np.array(mx.addmm(mx.array(c3), mx.array(x4[:3]), mx.array(w).T, alpha=0.5, beta=2.0)),
                        2.0 * c3.astype(np.float64) + 0.5 * (x4[:3].astype(np.float64) @ w.T))
a = f32(64, 576)
errs["64 rows"] = (np.array(mx.array(a) @ mx.array(w).T), a.astype(np.float64) @ w.T)
out = {k: float(np.max(np.abs(got - want))) for k, (got, want) in errs.items()}
few = counter.value - few_before if counter is not None else None
maps = open("/proc/self/maps").read()
print(json.dumps({"report": report.to_dict(), "errs": out, "few_rows_calls": few, "maps": maps}))
"""


def run_products(tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    """Run :data:`PRODUCTS` in a fresh process under the loader's binding trace."""
    trace = tmp_path / "ld"
    r = subprocess.run([sys.executable, "-c", PRODUCTS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(trace), **(env or {})})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    # "binding file <libmlx.so> [0] to <library> [0]: normal symbol `cblas_sgemm'"
    out["mlx_sgemm"] = sorted({line.split(" to ")[1].split(" [")[0]
                               for f in tmp_path.glob("ld.*") for line in f.read_text().splitlines()
                               if "libmlx.so" in line.split(" to ")[0] and "`cblas_sgemm'" in line})
    return out


@needs_openblas
def test_mlx_binds_its_sgemm_to_the_forwarder_and_every_product_is_right(tmp_path):
    out = run_products(tmp_path)
    report = out["report"]
    assert report["kind"] == "optimized" and report["gemv_forward"], report
    assert report["gemv_reason"] is None and report["gemv_fix"] is None
    assert out["mlx_sgemm"] == [report["gemv_forward"]]  # the loader bound MLX's matmul here
    assert report["gemv_forward"] in out["maps"] and report["library"] in out["maps"]
    for name, err in out["errs"].items():
        assert err < 1e-3, (name, err)  # float32 sums of 576 products against float64
    assert "sgemm" not in out["stderr"]
    # the batch (3 x 1 rows: MLX multiplies them as one 3-row matrix), 4-row, 7-row and
    # 3-row products went to the few-row kernel, and no more (the 64-row one to sgemm)
    assert out["few_rows_calls"] == 4, out["few_rows_calls"]


@needs_openblas
def test_few_row_products_can_go_back_to_sgemm(tmp_path):
    out = run_products(tmp_path, {gemv_forward.FEW_ROWS_ENV: "0"})
    assert out["report"]["gemv_forward"] and out["few_rows_calls"] == 0
    assert max(out["errs"].values()) < 1e-3


@needs_openblas
def test_turned_off_mlx_binds_the_blas_itself(tmp_path):
    out = run_products(tmp_path, {gemv_forward.ENV: "0"})
    report = out["report"]
    assert report["kind"] == "optimized" and report["gemv_forward"] is None
    assert report["gemv_reason"] == f"{gemv_forward.ENV}=0" and report["gemv_fix"] is None
    assert len(out["mlx_sgemm"]) == 1 and "openblas" in out["mlx_sgemm"][0]
    assert "ringlet-blas-gemv" not in out["maps"]
    assert max(out["errs"].values()) < 1e-3
    assert out["stderr"] == ""


@needs_openblas
@pytest.mark.parametrize("cc, says", [("/nonexistent/cc", "no C compiler"), ("/bin/false", "could not build it")])
def test_without_a_working_compiler_it_says_so_once_and_matmuls_still_run(tmp_path, cc, says):
    """An empty machine cache and no usable compiler: one warning line with the fix, the
    BLAS itself in use, and every product still right."""
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    out = run_products(tmp_path, {"CC": cc, "PATH": str(empty_path) if cc.startswith("/nonexistent") else "/bin",
                                  "XDG_CACHE_HOME": str(tmp_path / "cache")})
    report = out["report"]
    assert report["kind"] == "optimized" and report["gemv_forward"] is None
    assert says in report["gemv_reason"]
    if says == "no C compiler":
        assert "gcc" in report["gemv_fix"]
    assert "openblas" in out["mlx_sgemm"][0]
    assert max(out["errs"].values()) < 1e-3
    lines = [ln for ln in out["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and "sgemv" in lines[0] and says in lines[0], out["stderr"]


def test_the_library_is_built_once_per_source_and_needs_at_most_libc_and_openmp(tmp_path):
    path, reason = gemv_forward.build(tmp_path)
    if path is None:
        pytest.skip(reason)
    assert path.parent == tmp_path and path.name.startswith("ringlet-blas-gemv-") and path.suffix == ".so"
    before = path.stat().st_mtime_ns
    assert gemv_forward.build(tmp_path) == (path, None) and path.stat().st_mtime_ns == before
    assert [p for p in tmp_path.iterdir()] == [path]  # no temporary file left behind
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    if dynamic.returncode == 0:  # OpenMP's runtime (and libc) where the compiler has it, else nothing
        needed = {line.split("[")[1].split("]")[0] for line in dynamic.stdout.splitlines() if "(NEEDED)" in line}
        assert needed <= {"libgomp.so.1", "libc.so.6"}, needed


#: mutants of the C source, in bounds but wrong, and the first product the check must
#: find wrong: the M == 1 branch passes beta as alpha; the few-row kernel drops the
#: columns past the last whole vector (K = 37 is not a multiple of its width)
MUTANTS = {"tb ? k : n, alpha, b, ldb": ("tb ? k : n, beta, b, ldb", "1x37x9"),
           "for (int q = p; q < k; q++)": ("for (int q = p; q < p; q++)", "2x37x9")}


def _bound(lib, blas):
    lib.ringlet_gemv_forward_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.ringlet_gemv_forward_bind(ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p),
                                  ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p), 1)
    return lib


@needs_openblas
@pytest.mark.parametrize("original", sorted(MUTANTS))
def test_the_check_catches_a_forwarder_that_computes_wrongly(tmp_path, original):
    """A mutant of the C source must fail the check that runs before any process relies
    on the library; the source itself passes it."""
    source = gemv_forward.SOURCE.read_text()
    replacement, first_wrong = MUTANTS[original]
    wrong = source.replace(original, replacement)
    assert wrong != source
    (tmp_path / "mutant.c").write_text(wrong)
    lib = tmp_path / "mutant.so"
    cc = gemv_forward._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run([cc, *gemv_forward.CFLAGS, *gemv_forward.VARIANTS[-1], "-o", str(lib), str(tmp_path / "mutant.c")],
                   check=True)
    blas = ctypes.CDLL(ctypes.util.find_library("openblas"))
    mutant = _bound(ctypes.CDLL(str(lib)), blas)  # local: nothing in this process binds to it
    reason = gemv_forward._check(mutant.cblas_sgemm)
    assert reason is not None and first_wrong in reason, reason
    original_lib = _bound(ctypes.CDLL(str(gemv_forward.build(tmp_path / "good")[0])), blas)
    assert gemv_forward._check(original_lib.cblas_sgemm) is None
