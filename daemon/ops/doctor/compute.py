"""``ringlet doctor`` checks of the compute path: the BLAS under MLX's CPU backend
(:mod:`ringlet.daemon.probes.blas`) and the precision ``--dtype auto`` would load
(:mod:`ringlet.daemon.engine.dtype`), each with the fix when it is the slow path."""

from __future__ import annotations

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context


def check_blas(ctx: Context) -> Check:
    """OK on an optimized (or the platform's) BLAS; WARN, with the fix, on MLX's bundled one
    or when decode's matrix-vector products cannot go to sgemv for want of a compiler."""
    from ringlet.daemon.probes import blas

    r = blas.load()  # `ringlet doctor` loaded it already, before MLX; this only reads the report
    details = {**r.to_dict(), "mapped": blas.mapped_blas_libraries()}
    if r.kind == "platform":
        return Check("blas", OK, "MLX uses the platform's own libraries (Accelerate / Metal)", details=details)
    if r.kind == "optimized":
        threads = f", {r.threads} threads" if r.threads else ""
        core = f", OPENBLAS_CORETYPE={r.coretype}" if r.coretype else ""
        where = f"MLX's CPU matmuls run on {r.library}{threads}{core}"
        if r.gemv_forward:
            return Check("blas", OK, f"{where}; matrix-vector products (decode) through its sgemv", details=details)
        slow = f"{where}; matrix-vector products (decode) through its sgemm, ~2x slower: {r.gemv_reason}"
        return Check("blas", WARN if r.gemv_fix else OK, slow, r.gemv_fix, details=details)
    return Check("blas", WARN, f"MLX's CPU matmuls run on its bundled reference BLAS (~30x slower): {r.reason}",
                 r.fix, details=details)


def check_dtype(ctx: Context) -> Check:
    """What ``--dtype auto`` loads for the model on this machine, WARN when that is the slow path."""
    from ringlet.daemon.engine.dtype import resolve_dtype
    from ringlet.daemon.engine.hub import locate
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.probes.memory import probe_memory

    try:
        location = locate(ctx.model)
        choice = resolve_dtype("auto", location, probe_memory().usable_memory_bytes)
    except (RingletError, OSError, ValueError) as exc:
        return Check("dtype", FAIL, f"cannot size the model's weights: {exc}", "see the model check above")
    if choice.slow_path:
        return Check("dtype", WARN, f"--dtype auto keeps {location.name} quantized: {choice.reason}",
                     "give this node more memory (or fewer layers: more nodes), or run on Metal",
                     details=choice.to_dict())
    details = choice.to_dict()
    summary = f"--dtype auto loads {location.name} as {choice.loaded}: {choice.reason}"
    cache = _weights_cache(location, choice.dtype)
    if cache is not None:
        details["weights_cache"] = cache
        summary += (f"; {cache['files']} of its {cache['of']} layer files are in the dequantized-weights cache "
                    f"({cache['path']})")
    return Check("dtype", OK, summary, details=details)


def _weights_cache(location, dtype: str | None) -> dict | None:
    """What the machine's dequantized-weights cache holds of a GGUF model in ``dtype``:
    files held, of how many, bytes, the budget; ``None`` when nothing would be cached."""
    from ringlet.daemon.engine import dequant_cache
    from ringlet.daemon.engine.gguf import open_gguf
    from ringlet.daemon.engine.stage import DTYPES

    if location.kind != "gguf" or dtype is None:
        return None
    cache = dequant_cache.DequantCache.open(location.path, DTYPES[dtype])
    if cache is None:
        return None
    held = cache.held()
    groups = {dequant_cache.group_of(name) for name in open_gguf(location.path).tensors}
    return {"path": str(cache.folder), "files": len(held.keys() & groups), "of": len(groups),
            "bytes": sum(held.values()), "budget_bytes": dequant_cache.budget_bytes()}
