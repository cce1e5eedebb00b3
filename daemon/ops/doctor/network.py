"""``ringlet doctor`` checks of the network: multicast interfaces for discovery (nothing is
sent), the gRPC and API ports (free, or held by a ringlet daemon), the firewall,
Thunderbolt links and the Thunderbolt Bridge loop, and whether a daemon answers."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context, run_command

MDNS_PORT = 5353
SOCKETFILTERFW = "/usr/libexec/ApplicationFirewall/socketfilterfw"


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
    skipped = ""
    if ctx.interfaces:
        chosen = ctx.interfaces
    else:
        from ringlet.daemon.cluster.addresses import interface_addresses, skipped_interfaces, virtual_kind

        chosen = [n for n, i in sorted(infos.items())
                  if i["up"] and not i["loopback"] and "multicast" in i["flags"] and i["ipv4"] and not virtual_kind(n)]
        skips = skipped_interfaces()
        if skips:
            skipped = "; skips " + ", ".join(f"{n} ({', '.join(a)}: {k})" for n, a, k in skips)
        advertised = [a for a in interface_addresses(None) if not a.startswith("127.")]
        if advertised:
            also = (f" (and may be dialled at {', '.join(advertised[1:])}: each peer uses the fastest that "
                    "answers)" if len(advertised) > 1 else "")
            skipped = f"; advertises {advertised[0]} to its peers{also}" + skipped
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
                     f"cannot discover this one{skipped}",
                     "connect a network (Ethernet, Thunderbolt Bridge), or list peers with ringlet run --peers "
                     "HOST:PORT,...; for a cluster on one machine use --interface 127.0.0.1")
    if problems and not good:
        return Check("multicast", FAIL, "; ".join(problems),
                     "bring the interface up with an address, or choose others with --interface")
    summary = "mDNS on " + ", ".join(good) + ("; " + "; ".join(problems) if problems else "") + skipped
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
        # the daemon these options describe holds them: what doctor then checks (below), not
        # a problem; a second daemon on this machine would need others
        return Check("ports", OK, f"held by the running ringlet daemon these options describe (node "
                     f"{running.get('node_id', '?')}, state {running.get('state', '?')}): "
                     + ", ".join(f"{k} {p}" for k, (p, _) in busy.items())
                     + "; a second daemon on this machine needs its own --port, --api-port and --data-dir")
    parts = [f"{k} {p}: {e}{_owner(p)}" for k, (p, e) in busy.items()]
    return Check("ports", FAIL, "; ".join(parts),
                 "stop the program holding the port, or choose others with --port / --api-port")


def check_firewall(ctx: Context) -> Check:
    if ctx.platform == "darwin":
        rc, out = run_command([SOCKETFILTERFW, "--getglobalstate"])
        if rc == 127:
            return Check("firewall", OK, "application firewall tool not found; nothing to check")
        m = re.search(r"State = (\d)", out)
        state = int(m.group(1)) if m else (0 if "disabled" in out.lower() else 1 if "enabled" in out.lower() else None)
        if state is None:
            return Check("firewall", WARN, f"cannot read the firewall state: {out[:80]!r}",
                         "System Settings → Network → Firewall: check that Python may accept connections")
        if state == 0:
            return Check("firewall", OK, "macOS application firewall is off")
        _, block_all = run_command([SOCKETFILTERFW, "--getblockall"])
        python = os.path.realpath(sys.executable)
        allow = (f"sudo {SOCKETFILTERFW} --add {python} && sudo {SOCKETFILTERFW} --unblockapp {python}")
        if state == 2 or ("block all" in block_all.lower() and "enabled" in block_all.lower()):
            return Check("firewall", FAIL, "macOS firewall blocks all incoming connections: peers cannot reach "
                         "this node", "System Settings → Network → Firewall → Options: turn off 'Block all "
                         f"incoming connections', then: {allow}")
        return Check("firewall", WARN, "macOS application firewall is on: it may ask, or silently refuse, "
                     "incoming connections to Python (gRPC, API, mDNS)", f"allow this Python: {allow}")
    if shutil.which("ufw") and os.geteuid() == 0:
        rc, out = run_command(["ufw", "status"])
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


def read_cluster(api_port: int) -> dict | str:
    """The running daemon's ``/v1/cluster`` answer, or why it could not be read."""
    try:
        import httpx

        from ringlet.daemon.ops.client import auth_headers
        from ringlet.daemon.wire.auth import client_api_key

        resp = httpx.get(f"http://127.0.0.1:{api_port}/v1/cluster", timeout=3.0, trust_env=False,
                         headers=auth_headers(client_api_key()))
        if resp.status_code != 200:
            return f"/v1/cluster answered {resp.status_code} (set RINGLET_API_KEY if the node has API keys)"
        data = resp.json()
        return data if isinstance(data, dict) else "/v1/cluster answered no JSON object"
    except Exception as exc:  # noqa: BLE001 - a check reports, it never raises
        return f"could not read /v1/cluster: {type(exc).__name__}: {exc}"


def _routes_of(api_port: int) -> list[dict] | str:
    """The running daemon's ``/v1/cluster`` ``routes`` (addresses members could not reach),
    or why they could not be read."""
    cluster = read_cluster(api_port)
    if isinstance(cluster, str):
        return cluster
    return [r for r in cluster.get("routes") or [] if isinstance(r, dict)]


def check_daemon(ctx: Context) -> Check:
    """Whether a daemon runs on this machine's API port and, if so, every address its
    cluster could not reach (as ``ringlet status`` lists them: which address, of which
    node, from which member, and the flag that pins a working one)."""
    running = _ringlet_on(ctx.api_port)
    if running is None:
        return Check("daemon", OK, f"no daemon answers on http://127.0.0.1:{ctx.api_port} (not running)")
    summary = (f"running on http://127.0.0.1:{ctx.api_port}: node {running.get('node_id', '?')}, "
               f"state {running.get('state', '?')}")
    routes = _routes_of(ctx.api_port)
    if isinstance(routes, str):
        return Check("daemon", WARN, f"{summary}; {routes}")
    from ringlet.daemon.cluster.routes import status_lines

    lines = status_lines(routes)
    if not lines:
        return Check("daemon", OK, f"{summary}; every member reaches every address it dials")
    fix = next((r.get("fix") for r in routes if r.get("fix")), None)
    bad = any(r.get("in_plan") or not r.get("via") for r in routes)
    return Check("daemon", FAIL if bad else WARN, f"{summary}; " + "; ".join(lines), fix,
                 details={"routes": routes})
