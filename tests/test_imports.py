"""What a ringlet process imports: loading a stage of the bundled (GGUF) model needs
mlx-lm's model code, not transformers (about 1 s of CPU at every daemon and rank
start); mlx-lm's package-level names still work, in any thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_gguf_stage_loads_without_transformers_and_mlx_lm_names_still_resolve():
    out = run("""
        import sys
        from ringlet.daemon.probes import blas
        blas.load()
        from ringlet.daemon.engine.sources import resolve
        from ringlet.daemon.engine.stage import load_stage
        stage = load_stage(resolve(None), 28, 30, dtype="float32")
        print(stage.start, stage.end, "transformers" in sys.modules)
        import mlx_lm
        from mlx_lm import stream_generate
        print(callable(mlx_lm.load), callable(stream_generate), "transformers" in sys.modules)
    """)
    assert out.splitlines() == ["28 30 False", "True True True"]


def test_the_first_lookups_from_several_threads_all_resolve():
    """Eight threads ask for package-level names at once: the package body runs once and
    every thread gets its name (none an AttributeError from a half-run body).

    The snippet leaves with ``os._exit`` after flushing, as ringlet's own entry point
    does (``ops.cli.entry``): a thread that ran MLX's code keeps a thread-local destructor
    that takes the GIL (``__call_tls_dtors`` -> ``PyGILState_Ensure``, seen in gdb); when
    it runs after the main thread has begun finalizing, the process aborts with
    "terminate called without an active exception" (4 runs in 20 on a busy machine),
    after all the output this test reads."""
    out = run("""
        import os, sys, threading, ringlet.daemon, mlx_lm
        assert "mlx_lm.utils" not in sys.modules  # the package body has not run yet
        got, errors = [], []
        def ask(name):
            try:
                got.append(getattr(mlx_lm, name).__name__)
            except Exception as exc:
                errors.append(repr(exc))
        names = ["load", "generate", "convert", "stream_generate"] * 2
        threads = [threading.Thread(target=ask, args=(n,)) for n in names]
        for t in threads: t.start()
        for t in threads: t.join()
        print(sorted(got), errors)
        try:
            mlx_lm.no_such_name
        except AttributeError as exc:
            print("AttributeError", exc)
        sys.stdout.flush()
        os._exit(0)
    """)
    assert out.splitlines() == [
        str(sorted(["load", "generate", "convert", "stream_generate"] * 2)) + " []",
        "AttributeError module 'mlx_lm' has no attribute 'no_such_name'",
    ]
