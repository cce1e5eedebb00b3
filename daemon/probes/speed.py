"""Speed probe: memory bandwidth (bytes/s) and matmul throughput (FLOP/s), measured with MLX.

What is measured, on MLX's default device (GPU on Apple silicon, CPU on the
Linux CPU build):

- **memory bandwidth**: ``mx.sum`` over a float32 array of 256 MiB (GPU) /
  128 MiB (CPU) -- larger than the caches -- counted as ``nbytes`` read per
  run. A streaming read is what decode does with the weights.
- **matmul**: ``a @ b`` of two n x n matrices, n = 4096 float16 (GPU) /
  512 float32 (CPU; the MLX CPU path has no fast fp16 GEMM), counted as
  ``2 * n**3`` FLOP per run.

Each is warmed up once, then run until ``budget_s / 2`` has passed (at least 3,
at most 20 runs); the median run time is used. With the default budget the
whole measurement takes about 0.6 s here (2 shared x86 cores) and is bounded
by roughly ``budget_s`` plus one run of each.

The result is cached in ``<data_dir>/probe_speed.json`` together with a
machine identity key (:func:`machine_key`); a missing, corrupt, other-format
or other-machine file leads to a new measurement (:func:`load_or_measure`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .common import ProbeParseError, excerpt, from_jsonable, to_jsonable

log = logging.getLogger("ringlet.daemon.probes")

CACHE_FILE = "probe_speed.json"
CACHE_FORMAT = 1
DEFAULT_BUDGET_S = 0.6


@dataclass(frozen=True)
class SpeedResult:
    """Measured speeds. ``memory_bandwidth_bytes_per_s`` in bytes/s, ``matmul_flops`` in FLOP/s."""

    memory_bandwidth_bytes_per_s: float
    matmul_flops: float
    device: str  # "gpu" / "cpu"
    matmul_dtype: str  # "float16" / "float32"
    matmul_n: int
    bandwidth_array_bytes: int
    seconds: float  # wall time of the whole measurement
    measured_at: float  # unix time
    mlx_version: str
    machine_key: str = ""


def machine_key(*parts: object) -> str:
    """Identity of the hardware + MLX a measurement belongs to, e.g.
    ``machine_key(os, chip, cpu_count, memory_bytes)``; the MLX version and
    default device are appended so an upgrade re-measures."""
    try:
        import mlx.core as mx

        tail = [f"mlx {mx.__version__}", str(mx.default_device())]
    except Exception:
        tail = ["no mlx"]
    return "|".join(str(p) for p in (*parts, *tail))


def _median_time(fn: Callable[[], object], budget_s: float, min_runs: int = 3, max_runs: int = 20) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compile, allocate
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def measure_speed(budget_s: float = DEFAULT_BUDGET_S) -> SpeedResult:
    """Run the benchmark now (see module docstring). Raises if MLX is unusable."""
    import mlx.core as mx

    t_start = time.perf_counter()
    gpu = mx.default_device() == mx.gpu
    n_bw = (256 if gpu else 128) * (1 << 20) // 4
    x = mx.ones((n_bw,), dtype=mx.float32)
    mx.eval(x)
    t_bw = _median_time(lambda: mx.sum(x), budget_s / 2)
    bw = x.nbytes / t_bw

    n, dtype = (4096, mx.float16) if gpu else (512, mx.float32)
    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    t_mm = _median_time(lambda: a @ b, budget_s / 2)
    flops = 2.0 * n**3 / t_mm
    return SpeedResult(
        memory_bandwidth_bytes_per_s=bw,
        matmul_flops=flops,
        device="gpu" if gpu else "cpu",
        matmul_dtype=str(dtype).removeprefix("mlx.core."),
        matmul_n=n,
        bandwidth_array_bytes=n_bw * 4,
        seconds=time.perf_counter() - t_start,
        measured_at=time.time(),
        mlx_version=mx.__version__,
    )


def read_cache(path: Path, key: str) -> SpeedResult | None:
    """The cached result if ``path`` holds a valid one for ``key``; else ``None`` (reason logged once)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # absent: measure, nothing to report
        return None
    except OSError as e:
        log.warning("probe speed: cannot read cache %s: %s", path, excerpt(str(e)))
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            raise ProbeParseError("unknown cache format")
        result = from_jsonable(SpeedResult, doc.get("result"))
        if result.memory_bandwidth_bytes_per_s <= 0 or result.matmul_flops <= 0:
            raise ProbeParseError("non-positive speeds")
    except (ValueError, RecursionError) as e:  # ProbeParseError and json errors are ValueErrors
        log.warning("probe speed: corrupt cache %s (%s), re-measuring", path, excerpt(str(e)))
        return None
    if result.machine_key != key:
        log.info("probe speed: cache is for another machine or MLX (%s), re-measuring", excerpt(result.machine_key))
        return None
    return result


def write_cache(path: Path, result: SpeedResult) -> None:
    """Write atomically (temp file + rename); failure is logged, not raised."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe_speed.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": CACHE_FORMAT, "result": to_jsonable(result)}, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except (OSError, ValueError, TypeError) as e:
        log.warning("probe speed: cannot write cache %s: %s", path, excerpt(str(e)))
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def load_or_measure(
    data_dir: Path | str,
    key: str,
    *,
    measure: Callable[[], SpeedResult] = measure_speed,
    force: bool = False,
) -> SpeedResult | None:
    """The cached speeds for ``key`` from ``data_dir``, or measure and cache them.

    ``None`` (one log line) only if the measurement itself fails (no usable MLX).
    """
    path = Path(data_dir) / CACHE_FILE
    if not force:
        cached = read_cache(path, key)
        if cached is not None:
            return cached
    try:
        result = measure()
    except Exception as e:
        log.warning("probe speed: benchmark failed (%s): %s", type(e).__name__, excerpt(str(e)))
        return None
    result = replace(result, machine_key=key)
    write_cache(path, result)
    return result
