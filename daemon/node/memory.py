"""Memory figures of this process: peak RSS and MLX's active bytes, and MLX's warm-up."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes: since :func:`reset_peak_rss` where it
    could reset it, else since the process started. Linux: ``VmHWM`` of ``/proc/self/status``
    (kB, proc(5)); elsewhere ``ru_maxrss`` (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Make the peak RSS this process's RSS now, so that :func:`peak_rss_bytes` measures what
    follows (a load) and not what came before (parsing a model's metadata, say). Linux 4.0
    and later: writing ``5`` to ``/proc/self/clear_refs`` (proc(5)). Returns whether it
    was reset (never on macOS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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


def set_cache_limit(nbytes: int) -> None:
    """Let MLX keep at most ``nbytes`` of freed buffers for reuse (``mx.set_cache_limit``);
    beyond that a freed buffer goes back to the system, so the process's memory follows
    what it holds. 0 or less: left as MLX sets it. Run it on the MLX worker thread."""
    if nbytes > 0:
        import mlx.core as mx

        mx.set_cache_limit(int(nbytes))
