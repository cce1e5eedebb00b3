"""``ringlet doctor`` checks of this machine: MLX and its device, the model (it resolves;
depth and size), memory against the model's size, the GPU wired limit (macOS) and
free disk space where the data dir lives."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context

GIB = 1 << 30
MIB = 1 << 20


def _fmt(n: float | None) -> str:
    from ringlet.daemon.ops.format import fmt_bytes

    return fmt_bytes(n)


def check_mlx(ctx: Context) -> Check:
    try:
        import mlx.core as mx
    except Exception as exc:  # not installed, or a broken wheel
        return Check("mlx device", FAIL, f"MLX does not import: {type(exc).__name__}: {exc}",
                     "pip install 'mlx>=0.32' (macOS on Apple silicon) or 'mlx[cpu]>=0.32' (Linux)")
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        metal = False
    try:
        value = mx.sum(mx.ones((64, 64)) @ mx.ones((64, 64))).item()
        assert value == 64 * 64 * 64  # noqa: S101 - a self-test inside try/except; -O only makes it weaker
    except Exception as exc:
        return Check("mlx device", FAIL, f"MLX imports but cannot compute: {type(exc).__name__}: {exc}",
                     "reinstall mlx in this environment (pip install --force-reinstall mlx)")
    device = str(mx.default_device())
    version = getattr(mx, "__version__", "?")
    if ctx.platform == "darwin":
        if not metal:
            return Check("mlx device", FAIL, f"MLX {version} on {device}: no Metal GPU",
                         "ringlet on macOS needs Apple silicon (M1 or later) with Metal")
        name = ""
        try:
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            name = f" ({info.get('device_name') or info.get('architecture')})"
        except Exception:  # noqa: S110 - the device name is decoration; its absence is fine
            pass
        return Check("mlx device", OK, f"MLX {version} on the Metal GPU{name}")
    note = " (the Linux build of MLX computes on the CPU)" if not metal else ""
    return Check("mlx device", OK, f"MLX {version} on {device}{note}")


def _model_bytes(location) -> int:
    p = Path(location.path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def check_model(ctx: Context) -> Check:
    """Every model the node serves (``ctx.models``, else ``ctx.model``, else the default) is
    found and its metadata read; FAIL names the first that is not. ``ctx.model_bytes`` becomes
    their weights' total, which the memory check compares with this machine's."""
    names = ctx.models or [ctx.model]
    found = [_one_model(name) for name in names]
    bad = next((c for c in found if isinstance(c, Check)), None)
    if bad is not None:
        return bad
    ctx.model_bytes = sum(b for _, b, _ in found)
    if len(found) == 1:
        summary, _, details = found[0]
        return Check("model", OK, summary, details=details)
    return Check("model", OK, f"{len(found)} models, {_fmt(ctx.model_bytes)} in all: "
                 + "; ".join(summary for summary, _, _ in found),
                 details={"models": [d for _, _, d in found], "bytes": ctx.model_bytes})


def _one_model(model: str | None) -> Check | tuple[str, int, dict]:
    """``(summary, weight bytes, details)`` of one model, or its FAIL."""
    from ringlet.daemon.engine.hub import locate
    from ringlet.daemon.engine.sources import DEFAULT_MODEL
    from ringlet.daemon.errors import RingletError

    name = model or DEFAULT_MODEL
    try:
        loc = locate(model)
    except RingletError as exc:
        return Check("model", FAIL, str(exc),
                     "give --model a model directory (config.json + *.safetensors), a .gguf file or a Hub name "
                     "(ORG/NAME[@REVISION])")
    nbytes = _model_bytes(loc)
    depth = ""
    try:
        from ringlet.daemon.engine.model_info import model_info

        depth = f", {model_info(loc).num_layers} layers"
    except Exception as exc:  # unreadable metadata is a FAIL: the daemon would stop on it
        return Check("model", FAIL, f"{name}: {loc.path}: cannot read its metadata: {exc}",
                     "check the files are complete (re-download or re-convert the model)")
    return (f"{name}: {loc.path} ({loc.kind}{depth}, {_fmt(nbytes)})", nbytes,
            {"path": str(loc.path), "bytes": nbytes})


def check_memory(ctx: Context) -> Check:
    from ringlet.daemon.ops.doctor.network import _ringlet_on, read_cluster
    from ringlet.daemon.probes.memory import probe_memory

    cluster = read_cluster(ctx.api_port) if _ringlet_on(ctx.api_port) is not None else None
    return memory_verdict(probe_memory(ctx.platform), ctx.model_bytes, cluster, models=max(1, len(ctx.models)))


def memory_verdict(mem, model_bytes: int | None, cluster: dict | str | None, models: int = 1) -> Check:
    """The memory check (pure): this machine's usable memory and the rule that set it (host
    RAM, GPU wired limit / Metal working set, this process's cgroup), and, when a daemon runs
    (``cluster``: its ``/v1/cluster``), what it offers the planner and why: the daemon may run
    in another cgroup than ``ringlet doctor`` (a systemd service, a container), and only its
    own figure is what the plans use. ``mem``: a :class:`~ringlet.daemon.probes.memory.MemoryInfo`;
    ``model_bytes``: the weights of the ``models`` the node serves, in all."""
    summary = (f"total {_fmt(mem.total_bytes)}, usable {_fmt(mem.usable_memory_bytes)} "
               f"({mem.usable_source or mem.usable_rule}), available now {_fmt(mem.available_bytes)}")
    details = {"total_bytes": mem.total_bytes, "usable_bytes": mem.usable_memory_bytes,
               "usable_source": mem.usable_source or mem.usable_rule}
    own = next((m for m in (cluster.get("members") or []) if isinstance(m, dict) and m.get("state") == "self"),
               None) if isinstance(cluster, dict) else None
    if own is not None and own.get("memory_usable_bytes") is not None:
        summary += (f"; the running daemon offers the planner {_fmt(own['memory_usable_bytes'])}"
                    + (f" ({own['memory_usable_source']})" if own.get("memory_usable_source") else ""))
        details["daemon_usable_bytes"] = own["memory_usable_bytes"]
        details["daemon_usable_source"] = own.get("memory_usable_source")
    if model_bytes and model_bytes > mem.usable_memory_bytes:
        need = -(-model_bytes // max(1, mem.usable_memory_bytes))
        what = "the model" if models == 1 else f"the {models} models"
        return Check("memory", OK, f"{summary}; {what} ({_fmt(model_bytes)}) need{'s' if models == 1 else ''} "
                     f"about {need} nodes like this one (the cluster splits {'it' if models == 1 else 'them'})",
                     details=details)
    return Check("memory", OK, summary, details=details)


def recommended_wired_limit_mb(total_bytes: int) -> int:
    """A GPU wired limit that leaves the OS 10 % of RAM (at least 6 GiB, at most 24 GiB)."""
    reserve = min(max(total_bytes // 10, 6 * GIB), 24 * GIB)
    return max(0, (total_bytes - reserve) // MIB)


def check_wired_limit(ctx: Context) -> Check:
    if ctx.platform != "darwin":
        return Check("gpu wired limit", OK, "skipped: macOS only (iogpu.wired_limit_mb)")
    from ringlet.daemon.probes.memory import probe_memory

    mem = probe_memory("darwin")
    rec = recommended_wired_limit_mb(mem.total_bytes)
    fix = (f"sudo sysctl iogpu.wired_limit_mb={rec}  (lets the GPU wire {_fmt(rec * MIB)} of "
           f"{_fmt(mem.total_bytes)}; resets at reboot: add 'iogpu.wired_limit_mb={rec}' to /etc/sysctl.conf "
           "to keep it)")
    if mem.wired_limit_bytes:
        return Check("gpu wired limit", OK, f"iogpu.wired_limit_mb is set: the GPU may wire "
                     f"{_fmt(mem.wired_limit_bytes)} of {_fmt(mem.total_bytes)}")
    ws = mem.max_recommended_working_set_bytes
    summary = (f"not set: the GPU may wire Metal's recommended {_fmt(ws)} of {_fmt(mem.total_bytes)}" if ws
               else "not set, and Metal's recommended working set is unknown")
    if ctx.model_bytes and ws and ctx.model_bytes > 0.9 * ws:
        return Check("gpu wired limit", WARN, summary + f"; the model is {_fmt(ctx.model_bytes)}", fix)
    return Check("gpu wired limit", OK, summary + f"; for big models: sudo sysctl iogpu.wired_limit_mb={rec}")


def _existing_parent(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(ctx: Context) -> Check:
    data_dir = ctx.data_dir or _default_data_dir()
    where = _existing_parent(data_dir)
    usage = shutil.disk_usage(where)
    summary = f"{_fmt(usage.free)} free at {where} (data dir {data_dir})"
    if not os.access(where, os.W_OK):
        return Check("disk space", FAIL, summary + "; not writable by this user",
                     f"give --data-dir a directory you can write, or fix the permissions of {where}")
    if usage.free < GIB:
        return Check("disk space", FAIL, summary, "free some space: the node needs at least 1 GiB for its caches")
    if ctx.model_bytes and usage.free < ctx.model_bytes:
        return Check("disk space", WARN, summary + f"; less than the model ({_fmt(ctx.model_bytes)}), which a node "
                     "without the files pulls from peers", "free space or point --data-dir at a larger disk")
    return Check("disk space", OK, summary)


def _default_data_dir() -> Path:
    from ringlet.daemon.paths import default_data_dir

    return default_data_dir()
