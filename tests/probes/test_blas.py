"""The optimized BLAS under MLX's CPU backend (daemon/probes/blas.py), on real processes.

Expected values come from numpy (float64 matmul) and from the process's own
``/proc/self/maps``; nothing is compared with ringlet's own output.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import httpx
import openai
import pytest

from ringlet.daemon.ops.demo import LocalCluster

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS loader is for Linux CPUs")
HAS_OPENBLAS = ctypes.util.find_library("openblas") is not None
needs_openblas = pytest.mark.skipif(not HAS_OPENBLAS, reason="no system OpenBLAS (make install brings it as root)")

CHECK = r"""
import json, sys
import numpy as np
from ringlet.daemon.probes import blas
report = blas.load()
import mlx.core as mx
rng = np.random.default_rng(1)
a = rng.standard_normal((64, 576)).astype(np.float32)
b = rng.standard_normal((576, 1536)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
err = float(np.max(np.abs(got - a.astype(np.float64) @ b.astype(np.float64))))
print(json.dumps({"report": report.to_dict(), "err": err, "maps": open("/proc/self/maps").read()}))
"""


def _run_check(env: dict[str, str] | None = None) -> dict:
    import os

    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


@needs_openblas
def test_mlx_runs_on_the_loaded_openblas_and_its_products_are_right():
    out = _run_check()
    report = out["report"]
    assert report["kind"] == "optimized" and report["reason"] is None
    assert "openblas" in report["library"].lower()
    mapped = [line.split()[-1] for line in out["maps"].splitlines() if len(line.split()) >= 6]
    assert report["library"] in mapped  # the process has it mapped
    assert out["err"] < 1e-2  # float32 sums of 576 products against the float64 reference
    assert report["threads"] >= 1
    assert out["stderr"] == ""  # nothing to warn about


def test_a_missing_library_falls_back_with_one_line():
    out = _run_check({"RINGLET_BLAS": "/nonexistent/libblas-test.so"})
    report = out["report"]
    assert report["kind"] == "bundled" and "/nonexistent/libblas-test.so" in report["reason"]
    assert report["fix"] and "libopenblas0-pthread" in report["fix"]
    assert "/nonexistent/libblas-test.so" not in out["maps"]
    assert out["err"] < 1e-2  # the bundled BLAS is slow, not wrong
    lines = [ln for ln in out["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and "bundled reference BLAS" in lines[0], out["stderr"]


def test_a_library_without_cblas_is_refused():
    libm = ctypes.util.find_library("m")
    out = _run_check({"RINGLET_BLAS": f"/lib/x86_64-linux-gnu/{libm}" if libm else "/lib/libm.so.6"})
    assert out["report"]["kind"] == "bundled"
    assert "cblas_sgemm" in out["report"]["reason"] or "no such file" in out["report"]["reason"]


def test_none_turns_it_off_without_a_warning():
    out = _run_check({"RINGLET_BLAS": "none"})
    assert out["report"]["kind"] == "bundled" and out["report"]["reason"] == "RINGLET_BLAS=none"
    assert out["stderr"] == ""
    assert "openblas" not in out["maps"].replace("scipy_openblas", "")  # numpy's own, suffixed copy aside


def test_openblas_coretype_is_honoured_and_left_unchanged():
    out = _run_check({"OPENBLAS_CORETYPE": "Haswell"})
    assert out["report"]["coretype"] == "Haswell"


@needs_openblas
def test_a_daemon_reports_its_blas_and_dtype_and_falls_back_when_told_to():
    """Two real single-node daemons: one on the system OpenBLAS, one pointed at a missing
    file. Both serve the same completion; /v1/cluster says what each runs on."""
    good = LocalCluster(1, extra_args=["--no-dashboard"]).start()
    bad = LocalCluster(1, extra_args=["--no-dashboard"], env={"RINGLET_BLAS": "/nonexistent/lib.so"}).start()
    try:
        answers = []
        for cluster in (good, bad):
            client = openai.OpenAI(base_url=cluster.api_urls[0] + "/v1", api_key="none")
            r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                          temperature=0)
            answers.append(r.choices[0].text)
        g = httpx.get(good.api_urls[0] + "/v1/cluster", timeout=5).json()
        b = httpx.get(bad.api_urls[0] + "/v1/cluster", timeout=5).json()
        assert g["blas"]["kind"] == "optimized" and g["blas"]["library"] in g["blas"]["mapped"]
        assert g["blas"]["gemv_forward"] in g["blas"]["mapped"]  # decode's products through sgemv
        assert g["dtype"]["requested"] == "auto" and g["dtype"]["loaded"] == "float32"  # a CPU, the model fits
        assert b["blas"]["kind"] == "bundled" and "/nonexistent/lib.so" in b["blas"]["reason"]
        assert not any("openblas" in p for p in b["blas"]["mapped"] if "scipy_openblas" not in p)
        assert answers[0] == answers[1]  # the same float32 arithmetic, another library
        log = bad.log_path(0).read_text()
        assert log.count("bundled reference BLAS") == 1, log
    finally:
        good.stop()
        bad.stop()


def test_co_located_processes_share_the_cores(tmp_path):
    """Two live registered processes split the cores; a process that is gone no longer
    counts and its entry is removed (expected counts by hand: 2, then 1)."""
    import os
    import time

    from ringlet.daemon.probes import blas, colocated

    procs = tmp_path / "procs"
    me = colocated.Registration(procs)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from ringlet.daemon.probes.colocated import Registration; "
        f"r = Registration({str(procs)!r}, 'rank'); print('ok', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        assert colocated.count(procs) == 2
        cores = len(os.sched_getaffinity(0))
        assert blas.default_threads(colocated.count(procs)) == max(1, cores // 2)
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    assert colocated.count(procs) == 1
    assert sorted(p.name for p in procs.iterdir()) == [str(os.getpid())]
    me.close()
    assert list(procs.iterdir()) == []


def test_ringlet_threads_fixes_the_count_and_threads_beats_it(tmp_path, monkeypatch):
    """``$RINGLET_THREADS`` is the count of a process given no ``--threads`` (the test
    suite's 2 workers on 2 cores run 1 each); ``--threads`` wins over it; without either
    the count follows the co-located processes."""
    from ringlet.daemon.probes import colocated

    monkeypatch.setenv("RINGLET_THREADS", "1")
    assert colocated.ThreadSizer(tmp_path / "procs").fixed == 1
    assert colocated.ThreadSizer(tmp_path / "procs", fixed=3).fixed == 3
    monkeypatch.delenv("RINGLET_THREADS")
    assert colocated.ThreadSizer(tmp_path / "procs").fixed is None


@pytest.mark.parametrize("module", ["ringlet.daemon.tensor.worker", "ringlet.daemon.ops.cli"])
def test_the_entry_points_import_no_mlx_before_they_load_the_blas(module):
    """A process binds MLX's matmuls to a BLAS when ``mlx.core`` is first imported: a
    rank (``tensor.worker``) or daemon (``ops.cli``) entry module that imported it at
    module level would leave every matmul on the reference BLAS, ~30x slower (a tensor
    group's 1,341-token prefill took 100 s instead of 8 s when rank_prefix did)."""
    code = f"import sys, {module}; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
