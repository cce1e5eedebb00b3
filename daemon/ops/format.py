"""Plain-text formatting of the cluster view's figures, shared by ``status`` and the dashboard.

Each function takes what ``/v1/cluster`` reports (numbers in bytes, seconds,
tokens/s, bytes/s; ISO 8601 or epoch timestamps) and returns a short string;
a missing value prints as an em dash.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

DASH = "—"


def fmt_bytes(n: float | None) -> str:
    """Binary units, as macOS and Linux report RAM: ``192 GiB``, ``287 MiB``."""
    if n is None:
        return DASH
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def fmt_pair(used: float | None, total: float | None) -> str:
    """``62/192 GiB`` (both in the unit of the total)."""
    if total is None or total <= 0:
        return fmt_bytes(used)
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
        if total >= size:
            t = total / size
            u = DASH if used is None else (f"{used / size:.0f}" if used / size >= 10 else f"{used / size:.1f}")
            return f"{u}/{t:.0f} {unit}" if t >= 10 else f"{u}/{t:.1f} {unit}"
    return f"{used}/{total} B"


def fmt_rate(tps: float | None) -> str:
    if tps is None:
        return DASH
    return f"{tps:.0f}" if tps >= 100 else f"{tps:.1f}"


def fmt_batch(mean: float | None, max_batch: int | None) -> str:
    """A stage's decode batch: ``2.4/8`` (mean over its last seconds / its limit); ``—``
    when it ran no forward lately (idle) or does not report batching."""
    if mean is None:
        return DASH
    m = f"{mean:.1f}" if mean < 10 else f"{mean:.0f}"
    return m if max_batch is None else f"{m}/{max_batch}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return DASH
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def fmt_bandwidth(bps: float | None) -> str:
    """Bytes/s as link speed in bits: ``40 Gb/s``."""
    if bps is None:
        return DASH
    bits = bps * 8
    for unit, size in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bits >= size:
            v = bits / size
            return f"{v:.0f} {unit}" if v >= 10 else f"{v:.1f} {unit}"
    return f"{bits:.0f} b/s"


def fmt_range(r: list[int] | None) -> str:
    return DASH if not r else f"[{r[0]}, {r[1]})"


def fmt_ts(ts: Any) -> str:
    """Event time as ``HH:MM:SS`` (unix seconds or ISO 8601); other values as given."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        try:
            return time.strftime("%H:%M:%S", time.localtime(ts))
        except (OverflowError, OSError, ValueError):
            return str(ts)
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
        except ValueError:
            return ts[:8]
    return DASH


def ts_key(ts: Any) -> float:
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        return float(ts)
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return 0.0


def compact(value: Any) -> str:
    """A policy / mode / negotiation value, whatever its shape, in a few words."""
    if value is None or value == "":
        return DASH
    if isinstance(value, dict):
        for key in ("name", "state", "phase", "policy", "mode"):
            if isinstance(value.get(key), str):
                extra = [f"{k} {v}" for k, v in value.items()
                         if k != key and isinstance(v, (str, int, float)) and not isinstance(v, bool)][:2]
                return " ".join([value[key]] + extra)
        return " ".join(f"{k}={v}" for k, v in list(value.items())[:3])
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value[:4])
    return str(value)


def policy_text(policy: Any) -> str:
    return compact(policy)


def mode_text(cluster: dict) -> str:
    """``pipeline``, ``tensor/ring``, ``hybrid/ring`` or ``pipeline (tensor refused)``."""
    mode = compact(cluster.get("mode"))
    backend = cluster.get("backend")
    if backend and backend != "none":
        mode += f"/{backend}"
    refused = cluster.get("mode_refused")
    if refused and not cluster.get("ranks"):
        asked = str(refused).split()[0] if str(refused).split()[0] in ("tensor", "hybrid") else "tensor"
        mode += f" ({asked} refused)"
    return mode


def main_word(value: Any) -> str:
    """The headline of a dict-shaped status (its ``state`` / ``name``), else :func:`compact`."""
    if isinstance(value, dict):
        for key in ("state", "name", "phase"):
            if isinstance(value.get(key), str):
                return value[key]
    return compact(value)
