"""The API URLs ``ringlet status`` and the dashboard ask: the ``--api`` URLs given
(normalised), this machine's daemon by default, and the members' ``api_url`` as
reachable from here."""

from __future__ import annotations

from urllib.parse import urlsplit

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops.status.values import as_str

DEFAULT_API = "http://127.0.0.1:8000"


def normalize_api_url(url: str) -> str:
    """``host:port`` / ``http://host:port/`` -> ``http://host:port``.

    Raises:
        RingletError: not an http(s) URL with a host.
    """
    text = (url or "").strip()
    if not text:
        raise RingletError("--api: empty URL; give a node's API base URL, e.g. http://127.0.0.1:8000")
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise RingletError(f"--api {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RingletError(f"--api {url!r}: not an http(s) URL with a host (e.g. http://127.0.0.1:8000)")
    if port == 0:
        raise RingletError(f"--api {url!r}: port 0")
    return text.rstrip("/")


def default_api_url() -> str:
    """This machine's daemon: the API address of the installed service's configuration
    (``ringlet service install``), else :data:`DEFAULT_API`."""
    try:
        from ringlet.daemon.ops.service.config import api_host, load_config

        cfg = load_config()
    except Exception:  # an unreadable configuration is service status's business, not ours
        return DEFAULT_API
    if cfg is None or (cfg.api_port is None and cfg.api_host is None):
        return DEFAULT_API
    return f"http://{api_host(cfg)}:{cfg.api_port or 8000}"


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")  # noqa: S104 - addresses compared, never bound


def member_api_url(member: dict) -> str | None:
    """A member's API URL, reachable from here: a wildcard host (a daemon bound to
    ``0.0.0.0`` reports ``http://0.0.0.0:8000``) is replaced by the host of its gRPC
    address; ``None`` when neither names a host."""
    url = as_str(member.get("api_url"))
    if not url:
        return None
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return None
    if host not in _WILDCARDS and host != "::":
        return url
    grpc = as_str(member.get("grpc_address")) or ""
    ghost = grpc.rsplit(":", 1)[0].strip("[]") if ":" in grpc else ""
    if ghost in _WILDCARDS or ghost == "::" or port is None:
        return None
    return f"{parts.scheme}://{'[' + ghost + ']' if ':' in ghost else ghost}:{port}"
