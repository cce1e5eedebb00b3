"""Reading the values of a ``/v1/cluster`` answer: every field is optional and may be of
any type, so each reader returns the value in the type expected, or ``None``."""

from __future__ import annotations

from typing import Any


def as_num(value: Any) -> float | None:
    """A finite number or ``None`` (bools and strings are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    return value


def as_int(value: Any) -> int | None:
    """An integer (a finite number, truncated) or ``None``."""
    v = as_num(value)
    return int(v) if v is not None else None


def as_str(value: Any) -> str | None:
    """A non-empty string or ``None``."""
    return value if isinstance(value, str) and value else None


def as_range(value: Any) -> list[int] | None:
    """A layer range ``[start, end]`` of two integers, or ``None``."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        a, b = as_int(value[0]), as_int(value[1])
        if a is not None and b is not None:
            return [a, b]
    return None


def as_progress(value: Any) -> float | None:
    """Loading progress as a fraction 0..1 (a value above 1 is read as a percentage)."""
    v = as_num(value)
    if v is None:
        return None
    if v > 1.0:
        v = v / 100.0
    return max(0.0, min(1.0, float(v)))


def as_download(value: Any) -> dict | None:
    """A node's download in progress (``/v1/cluster``'s ``download``): ``bytes_done``,
    ``bytes_total``, ``fraction`` (0..1), ``rate_bytes_per_s``, ``eta_s``, ``file``; ``None``
    when there is none or it is not a dict."""
    if not isinstance(value, dict):
        return None
    done, total = as_int(value.get("bytes_done")), as_int(value.get("bytes_total"))
    return {"bytes_done": done, "bytes_total": total,
            "fraction": max(0.0, min(1.0, done / total)) if done is not None and total else None,
            "rate_bytes_per_s": as_num(value.get("rate_bytes_per_s")), "eta_s": as_num(value.get("eta_s")),
            "file": as_str(value.get("file"))}


def first(*values: Any) -> Any:
    """The first value that is not ``None`` (``None`` when all are)."""
    for v in values:
        if v is not None:
            return v
    return None


def sum_known(values: list[float | None]) -> float | None:
    """The sum of the values that are known; ``None`` when none is."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def dicts(value: Any) -> list[dict]:
    """The dicts of a list (other items dropped); ``[]`` when it is not a list."""
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []
