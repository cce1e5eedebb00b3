"""A Hugging Face Hub on this machine, for tests: model repositories served over HTTP in
the Hub's URL layout, so that the real ``huggingface_hub`` client talks to it
(``HF_ENDPOINT``).

What it serves (the parts ``huggingface_hub`` 1.x/2.x uses to resolve, read headers and
download; checked against its source: ``hf_api.model_info``, ``file_download.
get_hf_file_metadata`` / ``http_get``, ``hf_api.parse_safetensors_file_metadata``):

* ``GET /api/models/<repo>[/revision/<rev>]``: ``id``, ``sha`` and ``siblings`` (with
  ``size``, ``blobId`` and, for ``*.safetensors``, ``lfs.sha256``);
* ``HEAD`` / ``GET /<repo>/resolve/<rev>/<file>``: ``X-Repo-Commit``, ``ETag`` (the sha256
  of an LFS file, the git blob sha1 of another), ``Content-Length``, ``Accept-Ranges``;
  ``Range: bytes=a-b`` / ``bytes=a-`` answered 206 with ``Content-Range``;
* errors as the Hub gives them: 404 with ``X-Error-Code`` ``RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``.

Each client may use its own endpoint ``<url>/n/<tag>``: the tag is stripped and logged
with every request (:attr:`FakeHub.log`), so a test tells which node asked for what.
``rate_bytes_per_s`` throttles response bodies (to interrupt a download half way);
``fail_downloads`` makes every whole-file GET of a weight file fail with 503.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's content (the Hub's ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


@dataclass
class Logged:
    """One request: ``tag`` (the client's endpoint tag), method, repo, revision, file
    (or ``api``), the ``Range`` header, the status and the body bytes sent so far."""

    tag: str
    method: str
    repo: str
    revision: str
    file: str
    range: str | None
    status: int = 0
    sent: int = 0
    done: bool = False


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


class FakeHub:
    """Model repositories over HTTP (see the module docstring), on ``host`` (default
    127.0.0.1; a network namespace's bridge address when the server socket is opened by a
    thread inside that namespace, as ``bench_hub`` does).

    Use as a context manager; :meth:`endpoint` gives the ``HF_ENDPOINT`` of a client.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.repos: dict[str, Repo] = {}
        self.log: list[Logged] = []
        self.rate_bytes_per_s: float | None = None
        #: answer 503 to every whole-file GET of a ``*.safetensors`` file (a Hub failing mid-way)
        self.fail_downloads = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # --- content --------------------------------------------------------------------

    def add_commit(self, repo: str, files: dict[str, bytes], ref: str | None = "main") -> str:
        """Add a commit of ``files`` to ``repo`` (moving ``ref`` to it); returns its hash."""
        digest = hashlib.sha1(usedforsecurity=False)
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        r = self.repos.setdefault(repo, Repo())
        r.commits[sha] = dict(files)
        if ref:
            r.refs[ref] = sha
        return sha

    def requests(self, tag: str | None = None, method: str | None = None) -> list[Logged]:
        """The requests logged (of the endpoint ``tag``, of ``method``), in order."""
        with self._lock:
            return [e for e in self.log if (tag is None or e.tag == tag) and (method is None or e.method == method)]

    def downloads(self, tag: str | None = None) -> list[Logged]:
        """The GETs of a file's content that were not header reads: no ``Range``, or a
        ``Range`` that does not start at byte 0 (a resumed download)."""
        return [e for e in self.requests(tag, "GET") if e.file not in ("", "api")
                and (e.range is None or not e.range.startswith("bytes=0-"))]

    # --- server ---------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                hub._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        # a short poll: shutdown() waits for the loop's next look (0.5 s by default)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub",
                         daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def endpoint(self, tag: str = "") -> str:
        """The ``HF_ENDPOINT`` of a client whose requests are logged under ``tag``."""
        return f"{self.url}/n/{tag}" if tag else self.url

    # --- requests -------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        tag = ""
        m = re.match(r"^/n/([^/]+)(/.*)$", path)
        if m:
            tag, path = m.group(1), m.group(2)
        entry = Logged(tag, "HEAD" if head else "GET", "", "", "", h.headers.get("Range"))
        with self._lock:
            self.log.append(entry)
        api = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?$", path)
        if api:
            entry.repo, entry.revision, entry.file = api.group(1), api.group(2) or "main", "api"
            return self._api(h, entry, head)
        res = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if res:
            entry.repo, entry.revision, entry.file = res.groups()
            return self._resolve(h, entry, head)
        self._error(h, entry, 404, "RepoNotFound", "unknown path")

    def _commit(self, entry: Logged) -> tuple[str, dict[str, bytes]] | None:
        repo = self.repos.get(entry.repo)
        if repo is None:
            return None
        sha = repo.refs.get(entry.revision, entry.revision)
        return (sha, repo.commits[sha]) if sha in repo.commits else ("", {})

    def _error(self, h, entry: Logged, status: int, code: str, message: str, sha: str = "") -> None:
        body = json.dumps({"error": message}).encode()
        entry.status = status
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if sha:
            h.send_header("X-Repo-Commit", sha)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
        entry.done = True

    def _found(self, h, entry: Logged) -> tuple[str, dict] | None:
        """The commit and files ``entry`` names, or ``None`` after a 404 the Hub's way."""
        found = self._commit(entry)
        if found is None:
            self._error(h, entry, 404, "RepoNotFound", f"Repository {entry.repo} not found")
            return None
        if not found[0]:
            self._error(h, entry, 404, "RevisionNotFound", f"Invalid rev id: {entry.revision}")
            return None
        return found

    def _api(self, h, entry: Logged, head: bool) -> None:
        if (found := self._found(h, entry)) is None:
            return None
        sha, files = found
        siblings = []
        for name, data in sorted(files.items()):
            s = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith(".safetensors"):
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": entry.repo, "modelId": entry.repo, "sha": sha, "private": False,
                           "siblings": siblings}).encode()
        entry.status = 200
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)
            entry.sent = len(body)
        entry.done = True

    def _resolve(self, h, entry: Logged, head: bool) -> None:
        if (found := self._found(h, entry)) is None:
            return None
        sha, files = found
        data = files.get(entry.file)
        if data is None:
            return self._error(h, entry, 404, "EntryNotFound", f"{entry.file} does not exist", sha)
        if self.fail_downloads and not head and entry.file.endswith(".safetensors") and not entry.range:
            return self._error(h, entry, 503, "ServiceUnavailable", "the Hub is down", sha)
        etag = hashlib.sha256(data).hexdigest() if entry.file.endswith(".safetensors") else git_blob_sha1(data)
        start, end, status = 0, len(data), 200
        if entry.range and not head:
            m = re.match(r"bytes=(\d+)-(\d*)$", entry.range.strip())
            if m:
                start = int(m.group(1))
                end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                status = 206
        entry.status = status
        h.send_response(status)
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(max(0, end - start)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.end_headers()
        if head:
            entry.done = True
            return
        pos, chunk = start, 64 * 1024
        t0 = time.monotonic()
        try:
            while pos < end:
                piece = data[pos:min(end, pos + chunk)]
                h.wfile.write(piece)
                pos += len(piece)
                entry.sent += len(piece)
                if self.rate_bytes_per_s:
                    ahead = entry.sent / self.rate_bytes_per_s - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        entry.done = True


def node_env(hub: FakeHub, tmp: Path, i: int, **more: str) -> dict[str, str]:
    """The environment of daemon ``i`` of a cluster on ``hub``: its own endpoint tag ``n<i>``
    (so the log says which node asked for what), its own Hugging Face cache under ``tmp``,
    and ``more``."""
    return {"HF_ENDPOINT": hub.endpoint(f"n{i}"), "HF_HUB_CACHE": str(tmp / f"hf{i}"), **more}


def point_hub_client(monkeypatch, endpoint: str, cache: str, offline: bool = False) -> None:
    """Point this process's ``huggingface_hub`` at ``endpoint`` and the cache ``cache``, as
    ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` would have at its import (it reads
    them once; the URL template is built from the endpoint then)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
