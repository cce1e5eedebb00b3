"""Memory figures of this process: peak RSS and MLX's active bytes, and MLX's warm-up."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def warm_up_mlx() -> None:
    """First MLX use on the worker thread (stream and allocator set-up)."""
    import mlx.core as mx
    import mlx_lm.models.cache  # noqa: F401 - imported by every stage

    mx.eval(mx.zeros((8, 8)) @ mx.zeros((8, 8)))


def mlx_active_bytes() -> int:
    import mlx.core as mx

    mx.clear_cache()
    return int(mx.get_active_memory())




def mlx_memory_bytes() -> tuple[int, int]:
    """MLX's active and peak memory now, bytes (``mx.get_active_memory``,
    ``mx.get_peak_memory``); unlike :func:`mlx_active_bytes` it frees no cache, so it
    may run on any thread."""
    import mlx.core as mx

    return int(mx.get_active_memory()), int(mx.get_peak_memory())
