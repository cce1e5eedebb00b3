"""``--dtype auto``: the precision a node loads its weights in.

On a CPU device MLX's quantized matmul uses no BLAS (a 576x1536 Q4 weight takes
55-83 ms for 64 rows here) while float32 runs on the optimized BLAS
(:mod:`ringlet.daemon.probes.blas`; about 1 ms for the same product). Half-precision
floats have no fast CPU GEMM in MLX either. So on a CPU, ``auto`` dequantizes (or
casts) the weights to float32 when the whole model fits in this node's usable memory
that way, whatever stage it is given; otherwise, and on Metal or CUDA, the model keeps
its own precision (memory-bound nodes run the quantized path).

Choices: ``auto`` (default), ``native`` (the model's own precision), ``float32``,
``float16``, ``bfloat16``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringlet.daemon.engine.sources import ModelLocation

CHOICES = ("auto", "native", "float32", "float16", "bfloat16")
#: Share of usable memory the float32 weights may take under ``auto``: the rest is for
#: KV caches, activations and the prefix store.
AUTO_WEIGHT_FRACTION = 0.6


@dataclass(frozen=True)
class DtypeChoice:
    """What ``--dtype`` resolved to.

    Attributes:
        dtype: ``None`` (the model's own precision) or ``float32`` / ``float16`` / ``bfloat16``:
            what :func:`ringlet.daemon.engine.stage.load_stage` takes.
        requested: the ``--dtype`` given.
        reason: one line for status and doctor.
        slow_path: the CPU runs quantized or half-precision weights (the fix is in ``reason``).
    """

    dtype: str | None
    requested: str
    reason: str
    slow_path: bool = False

    @property
    def loaded(self) -> str:
        """The precision loaded, for display (``native`` for the model's own)."""
        return self.dtype or "native"

    def to_dict(self) -> dict:
        """JSON-safe form (``/v1/cluster``'s ``dtype``)."""
        return {"requested": self.requested, "loaded": self.loaded, "reason": self.reason,
                "slow_path": self.slow_path}


def on_cpu() -> bool:
    """MLX's default device is the CPU (no Metal, no CUDA)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def weight_bytes(location: ModelLocation, dtype: str | None) -> int:
    """Bytes of the whole model's weights loaded as ``dtype`` (built lazily: nothing is read).

    Raises:
        ModelFormatError: unreadable or unsupported model.
    """
    from mlx.utils import tree_flatten

    from ringlet.daemon.engine.stage import build_lazy_model

    model, _ = build_lazy_model(location, dtype)
    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def resolve_dtype(requested: str | None, location: ModelLocation, usable_bytes: int | None,
                  cpu: bool | None = None) -> DtypeChoice:
    """Resolve ``--dtype`` for this node.

    Args:
        requested: one of :data:`CHOICES`, or ``None`` (= ``auto``).
        location: the model.
        usable_bytes: memory this node offers (``--memory-limit`` or the probe), or ``None``.
        cpu: whether MLX runs on the CPU (default: :func:`on_cpu`).

    Raises:
        ValueError: ``requested`` is not one of :data:`CHOICES`.
        ModelFormatError: the model cannot be sized.
    """
    requested = requested or "auto"
    if requested not in CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(CHOICES)}, not {requested!r}")
    cpu = on_cpu() if cpu is None else cpu
    if requested == "native":
        native_slow = cpu and weight_bytes(location, None) < weight_bytes(location, "float32")
        hint = "; on a CPU, --dtype auto or float32 is faster where memory allows" if native_slow else ""
        return DtypeChoice(None, requested, "--dtype native: the model's own precision" + hint, slow_path=native_slow)
    if requested != "auto":
        slow = cpu and requested != "float32"
        return DtypeChoice(requested, requested, f"--dtype {requested}"
                           + ("; on a CPU, float32 is faster" if slow else ""), slow_path=slow)
    if not cpu:
        return DtypeChoice(None, requested, "auto: a GPU keeps the model's own precision")
    native, wide = weight_bytes(location, None), weight_bytes(location, "float32")
    if native >= wide:
        return DtypeChoice(None, requested, "auto: the model is float32 already")
    if usable_bytes is not None and wide > AUTO_WEIGHT_FRACTION * usable_bytes:
        return DtypeChoice(None, requested,
                           f"auto: float32 weights ({wide / 1e9:.2f} GB) exceed {AUTO_WEIGHT_FRACTION:.0%} of usable "
                           f"memory ({usable_bytes / 1e9:.2f} GB); the quantized path is slower on a CPU: add "
                           "memory or nodes", slow_path=True)
    return DtypeChoice("float32", requested,
                       f"auto: CPU device, weights dequantized to float32 ({native / 1e6:.0f} MB -> "
                       f"{wide / 1e6:.0f} MB) for the optimized BLAS")
