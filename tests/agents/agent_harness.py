"""What tests/agents needs to drive the real coding-agent CLIs against a ring: where
``make agents`` installed them, an isolated home per run, a run with a hard timeout that
leaves no process behind, a capture proxy between client and node (the bodies a client
sends, the errors it gets), and each client's configuration for the bundled model's
8,192-token context (docs/agents.md explains every knob)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
#: where ``make agents`` installs the pinned CLIs (``RINGLET_AGENTS_DIR`` points elsewhere)
AGENTS_DIR = Path(os.environ.get("RINGLET_AGENTS_DIR") or ROOT / ".venv" / "agents")
BIN = AGENTS_DIR / "node_modules" / ".bin"
MODEL = "smollm2-135m"
CONTEXT = 8192
#: every client's traffic goes to 127.0.0.1: anything else (telemetry, update checks, npm)
#: meets a closed local port and fails at once
NOWHERE = "http://127.0.0.1:9"


def missing_clients() -> str:
    """Why the agent tests cannot run here ("" when they can)."""
    absent = [name for name in ("claude", "codex", "opencode") if not (BIN / name).exists()]
    if not absent:
        return ""
    return (f"{', '.join(absent)} not installed in {BIN}: `make agents` installs them with npm "
            "(apt-get install nodejs npm where npm is missing)")


# --- running a client --------------------------------------------------------------------


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def events(self) -> list[dict[str, Any]]:
        """The JSON objects of stdout, one per line (other lines skipped)."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def __str__(self) -> str:
        return (f"{' '.join(self.argv[:1] + [a if len(a) < 80 else a[:77] + '...' for a in self.argv[1:]])}"
                f" -> exit {self.returncode} in {self.seconds:.1f} s\n--- stdout\n{self.stdout[-4000:]}"
                f"\n--- stderr\n{self.stderr[-2000:]}")


class Sandbox:
    """One client run's world under ``root``: its HOME, XDG dirs, TMPDIR and a project
    directory as cwd, none of them the real ones; proxies that send any traffic not for
    127.0.0.1 to a closed local port."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.project = root / "project"
        for d in (self.home, self.project, root / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home), "TMPDIR": str(root / "tmp"),
            "XDG_CONFIG_HOME": str(self.home / ".config"), "XDG_DATA_HOME": str(self.home / ".local/share"),
            "XDG_CACHE_HOME": str(self.home / ".cache"), "XDG_STATE_HOME": str(self.home / ".local/state"),
            "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
            "HTTP_PROXY": NOWHERE, "HTTPS_PROXY": NOWHERE, "http_proxy": NOWHERE, "https_proxy": NOWHERE,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "npm_config_registry": NOWHERE + "/", "npm_config_offline": "true",
        }

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> Run:
        """Run ``argv`` in the project dir with no stdin; kill its whole process group at
        the end (and at ``timeout``, which fails the test)."""
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.project, env={**self.env, **(env or {})},  # noqa: S603 - a pinned CLI of .venv/agents
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout:.0f} s:\n"
                                 f"{Run(argv, -9, out, err, time.monotonic() - start)}") from None
        finally:
            _kill_group(proc.pid)
        return Run(argv, proc.returncode, out, err, time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- the capture proxy -------------------------------------------------------------------

HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
       "host", "content-length", "accept-encoding", "content-encoding"}


@dataclass
class Exchange:
    """One request a client sent through the proxy and the node's response."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or the raw text
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: str = ""

    def response_json(self) -> Any:
        try:
            return json.loads(self.response)
        except ValueError:
            return None

    def text(self) -> str:
        """The text the model produced in this response (streamed or not, any surface)."""
        if "text/event-stream" not in self.response_headers.get("content-type", ""):
            return _text_of(self.response_json() or {})
        out = []
        for line in self.response.splitlines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            try:
                ev = json.loads(line[5:])
            except ValueError:
                continue
            if ev.get("type") == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                out.append(ev["delta"]["text"])  # Anthropic messages
            elif ev.get("type") == "response.output_text.delta":
                out.append(ev["delta"])  # OpenAI Responses
            elif ev.get("choices"):
                out.append((ev["choices"][0].get("delta") or {}).get("content") or "")  # chat completions
        return "".join(out)


def _text_of(body: dict) -> str:
    if "choices" in body:
        return body["choices"][0]["message"].get("content") or ""
    if "output" in body:
        return "".join(c.get("text", "") for o in body["output"] if o.get("type") == "message" for c in o["content"])
    return "".join(c.get("text", "") for c in body.get("content") or () if c.get("type") == "text")


class CaptureProxy:
    """An HTTP proxy on 127.0.0.1 in front of one node: forwards every request as it
    came (bar hop-by-hop headers and compression) and keeps it with the node's response.
    Responses, server-sent events included, go back whole once the node has finished.
    With ``RINGLET_AGENTS_CAPTURE=<file>`` every exchange is also appended to that file
    as JSON lines (what each client sends: docs/agents.md)."""

    def __init__(self, upstream: str):
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._upstream = httpx.Client(base_url=upstream, timeout=300)
        self._dump = os.environ.get("RINGLET_AGENTS_CAPTURE")
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="capture-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> CaptureProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._upstream.close()

    def mark(self) -> int:
        """A position in :attr:`exchanges`; :meth:`since` returns what came after it."""
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int, path: str = "") -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges[mark:] if e.path.startswith(path)]

    def _forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Exchange:
        keep = [(k, v) for k, v in headers if k.lower() not in HOP]
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        ex = Exchange(method, path, {k.lower(): v for k, v in headers}, parsed)
        try:
            r = self._upstream.request(method, path, headers=[*keep, ("accept-encoding", "identity")], content=body)
            ex.status, ex.response_headers, ex.response = r.status_code, dict(r.headers), r.text
        except httpx.HTTPError as exc:
            ex.status, ex.response = 502, f"capture proxy: {exc!r}"
        with self._lock:
            self.exchanges.append(ex)
            if self._dump:
                with open(self._dump, "a") as f:
                    f.write(json.dumps(ex.__dict__) + "\n")
        return ex


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(chunks)
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _serve(self) -> None:
        ex = self.server.proxy._forward(self.command, self.path, list(self.headers.items()), self._body())  # type: ignore[attr-defined]
        payload = ex.response.encode()
        self.send_response(ex.status)
        for k, v in ex.response_headers.items():
            if k.lower() not in HOP | {"date", "server"}:
                self.send_header(k, v)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _serve


# --- the clients' configuration ----------------------------------------------------------


def claude_env(url: str, extra_body: dict | None = None, max_output: int = 48) -> dict[str, str]:
    """Claude Code pointed at ``url``: any API key, a short output cap, temperature 0
    through ``CLAUDE_CODE_EXTRA_BODY`` (its only way to send sampling fields), no
    non-essential traffic."""
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-ringlet",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_EXTRA_BODY": json.dumps(extra_body or {"temperature": 0})}


def claude(*args: str) -> list[str]:
    return [str(BIN / "claude"), "-p", "--model", MODEL, *args]


#: config.toml knobs that shrink Codex's ~9,000-token default request to a few hundred
CODEX_SMALL = """\
model_instructions_file = "{instructions}"
include_environment_context = false
include_apps_instructions = false
include_collaboration_mode_instructions = false
model_reasoning_summary = "none"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
shell_tool = {shell}
goals = false
apps = false
plugins = false
shell_snapshot = false
skill_search = false
tool_suggest = false
view_image = false

[agents]
enabled = false

[skills]
include_instructions = false

[tools.experimental_request_user_input]
enabled = false
"""


def codex_home(sandbox: Sandbox, url: str, small: bool = True, shell: bool = False,
               instructions: str = "You are a terse assistant. Answer in one short sentence.") -> dict[str, str]:
    """Write ``$CODEX_HOME/config.toml`` for a ringlet provider at ``url`` (``/v1``,
    Responses wire API); ``small``: the knobs of :data:`CODEX_SMALL`. Returns the env."""
    home = sandbox.root / "codex"
    home.mkdir(exist_ok=True)
    text = f'model = "{MODEL}"\nmodel_provider = "ringlet"\n'
    if small:
        (sandbox.root / "instructions.md").write_text(instructions + "\n")
        text += CODEX_SMALL.format(instructions=sandbox.root / "instructions.md", shell=str(shell).lower())
    text += f'\n[model_providers.ringlet]\nname = "ringlet"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
    (home / "config.toml").write_text(text)
    return {"CODEX_HOME": str(home)}


def codex(*args: str) -> list[str]:
    return [str(BIN / "codex"), *args]


def opencode_config(sandbox: Sandbox, url: str, small: bool = True, tools: tuple[str, ...] = (),
                    prompt: str = "You are a terse assistant. Answer in one short sentence.",
                    max_output: int = 48) -> None:
    """Write the project's ``opencode.json``: a ringlet provider at ``url`` through
    ``@ai-sdk/openai-compatible`` (bundled with opencode), the model's real limits, no
    title requests; ``small``: the build agent's own short prompt, temperature 0 and only
    ``tools``."""
    cfg: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json", "model": f"ringlet/{MODEL}", "share": "disabled",
        "autoupdate": False,
        "provider": {"ringlet": {
            "npm": "@ai-sdk/openai-compatible", "name": "ringlet",
            "options": {"baseURL": f"{url}/v1", "apiKey": "sk-ringlet"},
            "models": {MODEL: {"name": "SmolLM2 135M", "limit": {"context": CONTEXT, "output": max_output},
                               "temperature": True, "tool_call": True}}}},
        "agent": {"title": {"disable": True}},
    }
    if small:
        cfg["tools"] = {"*": False, **dict.fromkeys(tools, True)}
        cfg["agent"]["build"] = {"prompt": prompt, "temperature": 0}
    (sandbox.project / "opencode.json").write_text(json.dumps(cfg, indent=2))


#: opencode's own background work that would reach the network, turned off
OPENCODE_ENV = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
                "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1", "OPENCODE_DISABLE_AUTOCOMPACT": "1"}


def opencode(*args: str) -> list[str]:
    return [str(BIN / "opencode"), *args]
