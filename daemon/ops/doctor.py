"""``ringlet doctor``: check this machine for running a ringlet node, and say how to fix it.

Checks, in order (each prints ``OK``, ``WARN`` or ``FAIL``, and a ``fix:`` line
when there is something to do):

- **mlx device**: MLX imports and computes; on macOS the GPU (Metal) is there.
- **model**: the model resolves (:func:`ringlet.daemon.engine.sources.resolve`), with
  its depth and size.
- **memory**: total and usable memory (:func:`ringlet.daemon.probes.memory.probe_memory`)
  against the model's size.
- **gpu wired limit** (macOS): ``iogpu.wired_limit_mb`` and the advice to raise it
  for big models.
- **disk space**: free space where the data dir (node id, model cache) lives.
- **multicast**: the chosen interfaces are up, multicast-capable and addressed;
  the mDNS port can be bound. Nothing is sent on any interface.
- **ports**: the gRPC and API ports are free (or held by a ringlet daemon).
- **firewall**: macOS application firewall (``socketfilterfw``); ``ufw`` on Linux.
- **thunderbolt**: macOS: Thunderbolt links and the Thunderbolt Bridge loop
  (:func:`ringlet.daemon.probes.bridge_loop_warning`); Linux: XDomain peers.
- **secret**: the cluster secret file, if any, loads and is private.
- **service**: is ringlet installed as a service, and (Linux) lingering.
- **daemon**: does a daemon answer on the API port.

Options default to the service configuration (``ringlet service install``) when
there is one. A check that does not apply to this OS prints ``OK`` with
"skipped". A check that itself breaks prints ``WARN`` ("could not check"):
doctor never ends in a traceback. Exit status: 1 when any check FAILs, else 0
(2 for bad input).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"
GIB = 1 << 30
MIB = 1 << 20
MDNS_PORT = 5353
SOCKETFILTERFW = "/usr/libexec/ApplicationFirewall/socketfilterfw"


@dataclass
class Check:
    name: str
    status: str
    summary: str
    fix: str | None = None
    details: dict = field(default_factory=dict)


@dataclass
class Context:
    """What the checks look at (from the options, else the service configuration)."""

    platform: str
    model: str | None = None
    interfaces: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 7100
    api_port: int = 8000
    data_dir: Path | None = None
    secret_file: str | None = None
    config_source: str | None = None
    # filled by the model check, read by later ones
    model_bytes: int | None = None


def _fmt(n: float | None) -> str:
    from ringlet.daemon.ops.format import fmt_bytes

    return fmt_bytes(n)


def _run(cmd: list[str], timeout: float = 10.0) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)  # noqa: S603 - fixed argv lists, no shell
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except (subprocess.TimeoutExpired, OSError) as exc:
        return 124, str(exc)
    return p.returncode, (p.stdout + p.stderr).strip()


# --------------------------------------------------------------------------- checks


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
    from ringlet.daemon.engine.sources import DEFAULT_MODEL, resolve
    from ringlet.daemon.errors import RingletError

    name = ctx.model or DEFAULT_MODEL
    try:
        loc = resolve(ctx.model)
    except RingletError as exc:
        return Check("model", FAIL, str(exc),
                     "give --model a model directory (config.json + *.safetensors) or a .gguf file")
    ctx.model_bytes = _model_bytes(loc)
    depth = ""
    try:
        from ringlet.daemon.engine.model_info import model_info

        depth = f", {model_info(loc).num_layers} layers"
    except Exception as exc:  # unreadable metadata is a FAIL: the daemon would stop on it
        return Check("model", FAIL, f"{name}: {loc.path}: cannot read its metadata: {exc}",
                     "check the files are complete (re-download or re-convert the model)")
    return Check("model", OK, f"{name}: {loc.path} ({loc.kind}{depth}, {_fmt(ctx.model_bytes)})",
                 details={"path": str(loc.path), "bytes": ctx.model_bytes})


def check_memory(ctx: Context) -> Check:
    from ringlet.daemon.probes.memory import probe_memory

    mem = probe_memory(ctx.platform)
    summary = (f"total {_fmt(mem.total_bytes)}, usable {_fmt(mem.usable_memory_bytes)} "
               f"({mem.usable_rule}), available now {_fmt(mem.available_bytes)}")
    details = {"total_bytes": mem.total_bytes, "usable_bytes": mem.usable_memory_bytes}
    if ctx.model_bytes and ctx.model_bytes > mem.usable_memory_bytes:
        need = -(-ctx.model_bytes // max(1, mem.usable_memory_bytes))
        return Check("memory", OK, f"{summary}; the model ({_fmt(ctx.model_bytes)}) needs about {need} nodes "
                     "like this one (the cluster splits it)", details=details)
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


def _interfaces_info() -> dict[str, dict]:
    import psutil

    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    out = {}
    for name, st in stats.items():
        flags = set(getattr(st, "flags", "").split(",")) - {""}
        ipv4 = [a.address for a in addrs.get(name, []) if a.family == socket.AF_INET]
        out[name] = {"up": st.isup, "flags": flags, "ipv4": ipv4,
                     "loopback": "loopback" in flags or name.startswith("lo")}
    return out


def check_multicast(ctx: Context) -> Check:
    infos = _interfaces_info()
    by_ip = {ip: n for n, i in infos.items() for ip in i["ipv4"]}
    problems, good = [], []
    if ctx.interfaces:
        chosen = ctx.interfaces
    else:
        chosen = [n for n, i in sorted(infos.items())
                  if i["up"] and not i["loopback"] and "multicast" in i["flags"] and i["ipv4"]]
    for name in chosen:
        iface = by_ip.get(name, name)  # --interface also takes an IPv4 address
        i = infos.get(iface)
        if i is None:
            problems.append(f"{name}: no such interface")
        elif not i["up"]:
            problems.append(f"{iface}: down")
        elif not i["ipv4"]:
            problems.append(f"{iface}: no IPv4 address")
        elif not i["loopback"] and "multicast" not in i["flags"] and i["flags"]:
            problems.append(f"{iface}: not multicast-capable")
        else:
            good.append(f"{iface} ({i['ipv4'][0]})")
    bind = _bind_mdns()
    if not chosen:
        return Check("multicast", WARN, "no multicast-capable interface is up (only loopback): other machines "
                     "cannot discover this one", "connect a network (Ethernet, Thunderbolt Bridge), or list peers "
                     "with ringlet run --peers HOST:PORT,...; for a cluster on one machine use --interface 127.0.0.1")
    if problems and not good:
        return Check("multicast", FAIL, "; ".join(problems),
                     "bring the interface up with an address, or choose others with --interface")
    summary = "mDNS on " + ", ".join(good) + ("; " + "; ".join(problems) if problems else "")
    if bind:
        return Check("multicast", WARN, summary + f"; UDP {MDNS_PORT} cannot be shared: {bind}",
                     "another mDNS responder holds port 5353 exclusively; stop it or use --peers")
    if problems:
        return Check("multicast", WARN, summary, "fix or drop the interfaces listed with --interface")
    return Check("multicast", OK, summary)


def _bind_mdns() -> str | None:
    """Bind UDP 5353 as zeroconf does (address reuse); ``None`` when that works. Sends nothing."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            except OSError:
                pass
        s.bind(("", MDNS_PORT))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        s.close()


def _port_free(host: str, port: int) -> str | None:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        s.close()


def _ringlet_on(api_port: int) -> dict | None:
    try:
        import httpx

        data = httpx.get(f"http://127.0.0.1:{api_port}/healthz", timeout=1.0, trust_env=False).json()
        return data if isinstance(data, dict) and "state" in data else None
    except Exception:
        return None


def _owner(port: int) -> str:
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" by {psutil.Process(c.pid).name()} (pid {c.pid})"
    except Exception:  # noqa: S110 - AccessDenied on macOS without root, or a process gone meanwhile
        pass
    return ""


def check_ports(ctx: Context) -> Check:
    host = "0.0.0.0" if ctx.host in ("", "0.0.0.0") else ctx.host  # noqa: S104 - probing a bind, not serving
    busy = {}
    for label, port in (("gRPC", ctx.port), ("API", ctx.api_port)):
        err = _port_free(host if label == "gRPC" else "127.0.0.1", port)
        if err:
            busy[label] = (port, err)
    if not busy:
        return Check("ports", OK, f"gRPC {ctx.port} and API {ctx.api_port} are free")
    running = _ringlet_on(ctx.api_port)
    if running is not None:
        return Check("ports", WARN, f"in use by a running ringlet daemon (node {running.get('node_id', '?')}, "
                     f"state {running.get('state', '?')}): " + ", ".join(f"{k} {p}" for k, (p, _) in busy.items()),
                     "a second daemon on this machine needs its own --port, --api-port and --data-dir")
    parts = [f"{k} {p}: {e}{_owner(p)}" for k, (p, e) in busy.items()]
    return Check("ports", FAIL, "; ".join(parts),
                 "stop the program holding the port, or choose others with --port / --api-port")


def check_firewall(ctx: Context) -> Check:
    if ctx.platform == "darwin":
        rc, out = _run([SOCKETFILTERFW, "--getglobalstate"])
        if rc == 127:
            return Check("firewall", OK, "application firewall tool not found; nothing to check")
        m = re.search(r"State = (\d)", out)
        state = int(m.group(1)) if m else (0 if "disabled" in out.lower() else 1 if "enabled" in out.lower() else None)
        if state is None:
            return Check("firewall", WARN, f"cannot read the firewall state: {out[:80]!r}",
                         "System Settings → Network → Firewall: check that Python may accept connections")
        if state == 0:
            return Check("firewall", OK, "macOS application firewall is off")
        _, block_all = _run([SOCKETFILTERFW, "--getblockall"])
        python = os.path.realpath(sys.executable)
        allow = (f"sudo {SOCKETFILTERFW} --add {python} && sudo {SOCKETFILTERFW} --unblockapp {python}")
        if state == 2 or ("block all" in block_all.lower() and "enabled" in block_all.lower()):
            return Check("firewall", FAIL, "macOS firewall blocks all incoming connections: peers cannot reach "
                         "this node", "System Settings → Network → Firewall → Options: turn off 'Block all "
                         f"incoming connections', then: {allow}")
        return Check("firewall", WARN, "macOS application firewall is on: it may ask, or silently refuse, "
                     "incoming connections to Python (gRPC, API, mDNS)", f"allow this Python: {allow}")
    if shutil.which("ufw") and os.geteuid() == 0:
        rc, out = _run(["ufw", "status"])
        if rc == 0 and "status: active" in out.lower():
            return Check("firewall", WARN, "ufw is active: it may drop mDNS and ringlet's ports",
                         f"sudo ufw allow {MDNS_PORT}/udp && sudo ufw allow {ctx.port}/tcp && "
                         f"sudo ufw allow {ctx.api_port}/tcp")
        return Check("firewall", OK, "ufw is inactive")
    return Check("firewall", OK, "skipped: no application firewall to query on this OS "
                 "(check iptables/nftables allow UDP 5353 and the ringlet ports)")


def check_thunderbolt(ctx: Context) -> Check:
    if ctx.platform == "darwin":
        from ringlet.daemon.probes.macos_thunderbolt import bridge_loop_warning, probe_macos_thunderbolt

        tb = probe_macos_thunderbolt()
        if tb is None:
            return Check("thunderbolt", WARN, "could not read Thunderbolt ports (system_profiler/networksetup "
                         "failed)", "run ringlet doctor -v to see the failing command")
        live = [p for p in tb.ports if p.connected]
        peers = {p.peer_domain_uuid for p in live if p.peer_domain_uuid}
        machines = 1 + len(peers)
        warning = bridge_loop_warning(tb.bridge, tb.ports, machines)
        links = ", ".join(f"{p.interface or '?'} → {p.peer_name or 'device'} {p.speed_text or ''}".strip()
                          for p in live) or "no live links"
        bridge = f"; bridge {tb.bridge.name} {'up' if tb.bridge.up else 'down'}" if tb.bridge else ""
        if warning:
            return Check("thunderbolt", WARN, f"{links}{bridge}: {warning}",
                         "System Settings → Network → Thunderbolt Bridge → remove the Thunderbolt ports (or "
                         "sudo ifconfig bridge0 down); ringlet uses each Thunderbolt port on its own")
        return Check("thunderbolt", OK, f"{links}{bridge}")
    from ringlet.daemon.probes.linux_thunderbolt import read_linux_thunderbolt

    tb = read_linux_thunderbolt()
    if not tb.present:
        return Check("thunderbolt", OK, "no Thunderbolt bus (the thunderbolt module is not loaded); "
                     "Ethernet links are used")
    return Check("thunderbolt", OK, f"{len(tb.peers)} XDomain peer(s) cabled"
                 + ("; load thunderbolt-net for networking over them (modprobe thunderbolt-net)" if tb.peers else ""))


def check_secret(ctx: Context) -> Check:
    if not ctx.secret_file:
        return Check("secret", WARN, "no cluster secret: the node runs open (anyone on the network can join and "
                     "read prompts)", "ringlet secret new FILE, copy FILE to every node, run with --secret-file FILE")
    path = Path(ctx.secret_file).expanduser()
    if not path.is_file():
        return Check("secret", FAIL, f"{path} does not exist", f"ringlet secret new {path}")
    try:
        from ringlet.daemon.wire.auth import fingerprint, load_secret
    except ImportError:
        fingerprint = load_secret = None
    if load_secret is not None:
        try:
            fp = fingerprint(load_secret(path))
        except Exception as exc:  # SecretError: malformed or wrong mode -- its message says which
            return Check("secret", FAIL, f"{path}: {exc}", f"ringlet secret new {path} --force (then copy it to "
                         "every node)")
        return Check("secret", OK, f"{path} (fingerprint {fp}; equal on every node of the cluster)")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return Check("secret", WARN, f"{path} has mode {mode:o}", f"chmod 600 {path}")
    return Check("secret", OK, str(path))


def check_service(ctx: Context) -> Check:
    from ringlet.daemon.ops import service

    target = service.host_target()
    spath = service.service_file(target)
    if not spath.exists():
        return Check("service", OK, "not installed as a service (optional: ringlet service install)")
    summary = f"installed: {spath}"
    if target == "linux":
        user = os.environ.get("USER") or str(os.getuid())
        rc, out = _run(["loginctl", "show-user", user, "--property=Linger"], timeout=5)
        if rc == 0 and out.strip() == "Linger=no":
            return Check("service", WARN, summary + "; it starts only when you log in",
                         f"sudo loginctl enable-linger {user}")
    return Check("service", OK, summary)


def check_daemon(ctx: Context) -> Check:
    running = _ringlet_on(ctx.api_port)
    if running is None:
        return Check("daemon", OK, f"no daemon answers on http://127.0.0.1:{ctx.api_port} (not running)")
    return Check("daemon", OK, f"running on http://127.0.0.1:{ctx.api_port}: node {running.get('node_id', '?')}, "
                 f"state {running.get('state', '?')}")


CHECKS: list[tuple[str, Callable[[Context], Check]]] = [
    ("mlx device", check_mlx), ("model", check_model), ("memory", check_memory),
    ("gpu wired limit", check_wired_limit), ("disk space", check_disk), ("multicast", check_multicast),
    ("ports", check_ports), ("firewall", check_firewall), ("thunderbolt", check_thunderbolt),
    ("secret", check_secret), ("service", check_service), ("daemon", check_daemon),
]


def run_checks(ctx: Context) -> list[Check]:
    """Every check, in order; a check that raises becomes a WARN ("could not check")."""
    results = []
    for name, fn in CHECKS:
        try:
            results.append(fn(ctx))
        except Exception as exc:  # a broken probe must not hide the other checks
            results.append(Check(name, WARN, f"could not check: {type(exc).__name__}: {exc}",
                                 "please report this with the output of ringlet -v doctor"))
    return results


# --------------------------------------------------------------------------- CLI


def add_doctor_parser(subparsers) -> None:
    d = subparsers.add_parser("doctor", help="check this machine for running a node, with fixes",
                              description="Checks MLX, the model, memory, disk, network, firewall, Thunderbolt, "
                                          "secret and service. Options default to the service configuration. "
                                          "Exit status 1 when a check FAILs.")
    d.add_argument("--model", help="model to check (default: the service's, else the default model)")
    d.add_argument("--interface", action="append", metavar="NAME", help="discovery interface (repeatable)")
    d.add_argument("--host", help="gRPC bind address (default 127.0.0.1)")
    d.add_argument("--port", help="gRPC port (default 7100)")
    d.add_argument("--api-port", help="API port (default 8000)")
    d.add_argument("--data-dir", help="data dir (default: the platform's)")
    d.add_argument("--secret-file", help="cluster secret file")
    d.add_argument("--json", action="store_true", help="print the results as JSON")


def _port_arg(value, default: int, what: str) -> int:
    from ringlet.daemon.errors import RingletError

    if value is None:
        return default
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise RingletError(f"{what} {value!r}: not a port number") from None
    if not 1 <= port <= 65535:
        raise RingletError(f"{what} {port}: give a port in 1..65535")
    return port


def make_context(args: argparse.Namespace) -> Context:
    from ringlet.daemon.errors import RingletError
    from ringlet.daemon.ops import service

    try:
        cfg = service.load_config()
    except RingletError:
        cfg = None
    cfg = cfg or service.ServiceConfig()
    source = str(service.config_path()) if service.config_path().exists() else None
    data_dir = args.data_dir or cfg.data_dir
    return Context(
        platform=sys.platform,
        model=args.model or cfg.model,
        interfaces=list(args.interface or cfg.interfaces or []),
        host=args.host or cfg.host or "127.0.0.1",
        port=_port_arg(args.port if args.port is not None else cfg.port, 7100, "--port"),
        api_port=_port_arg(args.api_port if args.api_port is not None else cfg.api_port, 8000, "--api-port"),
        data_dir=Path(data_dir).expanduser() if data_dir else None,
        secret_file=args.secret_file or cfg.secret_file,
        config_source=source,
    )


def print_results(results: list[Check], ctx: Context, console=None) -> None:
    """One block per check: ``STATUS  name  summary`` and a ``fix:`` line, wrapped to the
    terminal at word boundaries (paths are never split), the status coloured on a TTY."""
    import textwrap

    from rich.console import Console
    from rich.text import Text

    console = console or Console(highlight=False)
    width = max(60, console.width)
    head = (f"ringlet doctor · {platform.system().lower()} {platform.machine()} · Python "
            f"{platform.python_version()} · {sys.executable}")
    console.print(Text(head, style="bold"), soft_wrap=True)
    if ctx.config_source:
        console.print(Text(f"using the service configuration {ctx.config_source} (options override it)",
                           style="dim"), soft_wrap=True)
    styles = {OK: "bold green", WARN: "bold yellow", FAIL: "bold red"}
    name_w = max(len(r.name) for r in results) if results else 0
    indent = " " * (6 + name_w + 2)

    def wrap(text: str, first: str) -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False) or [first]

    for r in results:
        lines = wrap(r.summary, indent)
        if r.fix:
            lines += wrap("fix: " + r.fix, indent)
        first = Text.assemble((f"{r.status:<6}", styles[r.status]), f"{r.name:<{name_w}}  ",
                              lines[0][len(indent):])
        console.print(first, soft_wrap=True)
        for line in lines[1:]:
            console.print(Text(line, style="bold" if line.lstrip().startswith("fix:") else ""), soft_wrap=True)
    warns = sum(r.status == WARN for r in results)
    fails = sum(r.status == FAIL for r in results)
    console.print(Text(f"{len(results)} checks: {len(results) - warns - fails} OK, {warns} WARN, {fails} FAIL",
                       style="bold red" if fails else "bold yellow" if warns else "bold green"))


def run_doctor(args: argparse.Namespace) -> int:
    ctx = make_context(args)
    results = run_checks(ctx)
    if args.json:
        print(json.dumps({"checks": [asdict(r) for r in results],
                          "failed": any(r.status == FAIL for r in results)}, indent=2, default=str))
    else:
        print_results(results, ctx)
    return 1 if any(r.status == FAIL for r in results) else 0
