"""Network-namespace lab: real ``ringlet run`` daemons, each in its own network
namespace, joined by veth pairs to a bridge that lives in a namespace of its own.

Layout (``T`` = the lab's prefix: ``rl<pid>``, then ``rl<pid>x2``, ... for further labs
of the same process; every name is unique per test run)::

    namespace Thub:  br0 (10.201.0.254/24)  -- the test's own client address
                      |-- h0 <== veth ==> veth0 in namespace Tn0 (10.201.0.1/24)
                      |-- h1 <== veth ==> veth0 in namespace Tn1 (10.201.0.2/24)
                      ...

:meth:`NetnsLab.add_link` gives a node a second link, to bridge ``br1`` (10.202.0.254/24)
in the hub namespace, as a host with two networks (Ethernet and Thunderbolt, say);
:meth:`NetnsLab.drop_route` deletes a node's route to one of them.

Nothing is created in the root namespace: no interface, address or route; no
packet leaves the namespaces (mDNS included). The test process talks to the
daemons from the hub namespace: :meth:`NetnsLab.call` runs a function in a
worker thread that has ``setns``-ed into it, and :func:`in_namespace` does the
same for a thread of the caller's own (sockets belong to the namespace of the
thread that opens them).

Links: :meth:`NetnsLab.shape` puts ``tbf`` on both ends of a node's veth pair;
:meth:`NetnsLab.cut` / :meth:`NetnsLab.restore` set it down / up;
:meth:`NetnsLab.drop_mdns` / :meth:`NetnsLab.allow_mdns` drop / pass its mDNS packets.

Cleanup: :meth:`NetnsLab.close` stops the daemons (SIGTERM, then SIGKILL) and
deletes the namespaces, which destroys the veths and the bridge with them; it
runs even after a failure (use the lab as a context manager or fixture).
:func:`cleanup_stale` removes what earlier, dead runs left behind (namespaces
named ``rl<pid>...`` whose pid no longer runs), never another live run's.

Needs root and iproute2 (``ip``, ``tc``): see :func:`skip_reason`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PREFIX = "rl"
SUBNET = "10.201.0"
HUB_IP = f"{SUBNET}.254"
#: The second network (:meth:`NetnsLab.add_link`): bridge ``br1`` in the hub namespace.
SUBNET2 = "10.202.0"
GRPC_PORT = 7100
API_PORT = 8000
_STALE = re.compile(rf"^{PREFIX}(\d+)(?:x\d+)?(?:hub|n\d+)$")
_CLONE_NEWNET = 0x40000000


def skip_reason() -> str | None:
    """Why namespace tests cannot run here, or ``None`` when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns, veth, tc); run as root (CI does)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (apt-get install -y iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command (no shell); raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_names() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL the processes still inside namespace ``ns`` (leftovers of a dead run)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by earlier runs of this harness whose process is gone
    (and kill what still runs inside them). Returns the names removed."""
    removed = []
    for ns in _netns_names():
        m = _STALE.match(ns)
        if not m or _pid_alive(int(m.group(1))):
            continue
        _kill_namespace_pids(ns)
        sh("ip", "netns", "delete", ns, check=False)
        removed.append(ns)
    return removed


# --------------------------------------------------------------------------- setns


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_namespace(ns: str) -> Iterator[None]:
    """Move the *calling thread* into network namespace ``ns`` for the block, then back.

    Only this thread moves; sockets opened inside the block stay in ``ns``. Use it in
    a thread of your own (e.g. a streaming client), never around code that hands
    work to other threads.
    """
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/var/run/netns/{ns}")
        try:
            yield
        finally:
            if _libc.setns(original, _CLONE_NEWNET) != 0:  # pragma: no cover - cannot happen as root
                err = ctypes.get_errno()
                raise OSError(err, f"could not return to the original network namespace: {os.strerror(err)}")
    finally:
        os.close(original)


# --------------------------------------------------------------------------- the lab


@dataclass
class Daemon:
    """One ``ringlet run`` in its namespace."""

    index: int
    ns: str
    ip: str
    data_dir: Path
    log_path: Path
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    #: started as a user would on a LAN host: ``--host 0.0.0.0 --api-host 0.0.0.0``, no
    #: ``--interface`` (the daemon picks its own addresses)
    wildcard: bool = False
    #: the node-side name of its link
    link: str = "veth0"
    #: its address on the second network (:meth:`NetnsLab.add_link`), if any
    ip2: str | None = None
    #: the node-side name of its link to the second network
    link2: str | None = None
    #: where the test reaches its API, if not at :attr:`ip` (e.g. its route there was deleted)
    api_ip: str | None = None
    #: more environment of its process (e.g. ``HF_ENDPOINT``)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://{self.api_ip or self.ip}:{API_PORT}"

    @property
    def grpc_address(self) -> str:
        return f"{self.ip}:{GRPC_PORT}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""


class NetnsLab:
    """Namespaces, veths, a bridge and daemons for one test; remove all with :meth:`close`.

    Args:
        cluster: the ``--cluster`` name (default: unique per lab).
        log_dir: where node logs and data dirs go (default: a temporary directory,
            removed on close; logs are printed by :meth:`dump_logs`).
    """

    _count = 0

    def __init__(self, cluster: str | None = None, log_dir: str | None = None):
        NetnsLab._count += 1
        # "rl<pid>hub", "rl<pid>n3"; a second lab of the same process: "rl<pid>x2hub", ...
        tag = f"{PREFIX}{os.getpid()}"
        self.prefix = f"{tag}x{NetnsLab._count}" if NetnsLab._count > 1 else tag
        self.cluster = cluster or f"netns-{os.getpid()}-{NetnsLab._count}-{int(time.time()) % 100000}"
        self.hub = f"{self.prefix}hub"
        self.daemons: list[Daemon] = []
        self._namespaces: list[str] = []
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="ringlet-netns-")
        self.dir = Path(log_dir or self._tmp.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._logs: list = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._client: httpx.Client | None = None
        self._made_hub = False
        self._made_bridge2 = False

    # --- topology ---------------------------------------------------------------------

    def _add_namespace(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _ensure_hub(self) -> None:
        if self._made_hub:
            return
        self._add_namespace(self.hub)
        self._add_bridge("br0", f"{HUB_IP}/24")
        self._made_hub = True

    def _add_bridge(self, name: str, address: str) -> None:
        """A switch ``name`` in the hub namespace, holding ``address`` (the test's own)."""
        sh("ip", "-n", self.hub, "link", "add", name, "type", "bridge")
        # plain flooding switch: no IGMP snooping state to warm up for mDNS
        sh("ip", "-n", self.hub, "link", "set", name, "type", "bridge", "mcast_snooping", "0")
        sh("ip", "-n", self.hub, "addr", "add", address, "dev", name)
        sh("ip", "-n", self.hub, "link", "set", name, "up")

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def hub_veth(self, i: int) -> str:
        """Name (in the hub namespace) of node ``i``'s switch-side veth end."""
        return f"h{i}"

    NODE_VETH = "veth0"  # name of the node-side end, inside each node's namespace

    def add_node(self, args: list[str] | None = None, share_namespace_with: Daemon | None = None, *,
                 bridges: tuple[tuple[str, str], ...] = (), wildcard: bool = False,
                 link_name: str | None = None) -> Daemon:
        """Create node ``i``'s namespace and link (not started yet: :meth:`start`). With
        ``share_namespace_with``, node ``i`` is a second daemon on that node's machine
        instead: its address is added to the same veth (cutting or shaping it acts on both).

        ``bridges``: ``(name, address/prefix)`` bridges created in the namespace *before*
        its link (as on a Docker host: ``("docker0", "172.17.0.1/16")``), so they come
        first in the interface list. ``wildcard``: start it without ``--host``,
        ``--api-host`` or ``--interface`` choices (:attr:`Daemon.wildcard`). ``link_name``:
        the node-side name of its link (default :attr:`NODE_VETH`; ``veth*`` names are
        container ports to a daemon choosing its own interfaces)."""
        self._ensure_hub()
        i = len(self.daemons)
        ip = f"{SUBNET}.{i + 1}"
        if share_namespace_with is not None:
            ns = share_namespace_with.ns
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", self.NODE_VETH)
            d = Daemon(index=i, ns=ns, ip=ip, data_dir=self.dir / f"data{i}", log_path=self.dir / f"node{i}.log",
                       args=list(args or []))
            self.daemons.append(d)
            return d
        ns = self.node_ns(i)
        self._add_namespace(ns)
        for name, address in bridges:
            sh("ip", "-n", ns, "link", "add", name, "type", "bridge")
            sh("ip", "-n", ns, "addr", "add", address, "dev", name)
            sh("ip", "-n", ns, "link", "set", name, "up")
        dev = link_name or self.NODE_VETH
        # both ends are created directly in their namespaces: nothing appears in the root one
        sh("ip", "-n", self.hub, "link", "add", self.hub_veth(i), "type", "veth", "peer", "name", dev,
           "netns", ns)
        sh("ip", "-n", self.hub, "link", "set", self.hub_veth(i), "master", "br0")
        sh("ip", "-n", self.hub, "link", "set", self.hub_veth(i), "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        d = Daemon(index=i, ns=ns, ip=ip, data_dir=self.dir / f"data{i}", log_path=self.dir / f"node{i}.log",
                   args=list(args or []), wildcard=wildcard, link=dev)
        self.daemons.append(d)
        return d

    def add_link(self, d: Daemon, dev: str = "eth1") -> str:
        """Give node ``d`` a second link, ``dev``, on a second network (bridge ``br1`` in the
        hub namespace, :data:`SUBNET2`): its address there is ``SUBNET2.<i+1>``, returned
        and kept as :attr:`Daemon.ip2`. Call before :meth:`start`."""
        if not self._made_bridge2:
            self._add_bridge("br1", f"{SUBNET2}.254/24")
            self._made_bridge2 = True
        hub_end, ip = f"{self.hub_veth(d.index)}b", f"{SUBNET2}.{d.index + 1}"
        sh("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", dev, "netns", d.ns)
        sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br1")
        sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
        sh("ip", "-n", d.ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", d.ns, "link", "set", dev, "up")
        d.ip2, d.link2 = ip, dev
        return ip

    def drop_route(self, d: Daemon, subnet: str) -> None:
        """Delete node ``d``'s route to ``subnet``.0/24 (its connected route): it can no longer
        send to that network, so its address there stops working for every peer."""
        sh("ip", "-n", d.ns, "route", "del", f"{subnet}.0/24")

    # --- links --------------------------------------------------------------------------

    def shape(self, i: int, rate: str = "100mbit", burst: str = "32kbit", latency: str = "400ms",
              second: bool = False) -> None:
        """Rate-limit node ``i``'s link in both directions (``tbf`` on both veth ends); with
        ``second``, its link to the second network (:meth:`add_link`)."""
        ends = ((self.hub, f"{self.hub_veth(i)}b"), (self.node_ns(i), self.daemons[i].link2)) if second else (
            (self.hub, self.hub_veth(i)), (self.node_ns(i), self.daemons[i].link))
        for ns, dev in ends:
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
               "latency", latency)

    def cut(self, i: int, side: str = "hub") -> None:
        """Cut node ``i`` off: set its veth down on the switch side (``hub``, like pulling
        the cable at the switch) or inside the node (``node``)."""
        sh(*self._link_cmd(i, side), "down")

    def restore(self, i: int, side: str = "hub") -> None:
        """Undo :meth:`cut`."""
        sh(*self._link_cmd(i, side), "up")

    MDNS_SINK = "mdnsnull"  # a veth end whose peer is down: what is sent there is dropped

    def drop_mdns(self, d: Daemon) -> None:
        """Drop every mDNS packet (UDP port 5353) into and out of daemon ``d``'s link, as a
        busy or lossy host loses them; gRPC and everything else still pass. ``tc`` filters on
        the node's veth redirect them to a sink (no iptables or nftables needed, nor the
        ``gact`` action module): :meth:`allow_mdns` removes them."""
        if shutil.which("tc") is None:
            raise RuntimeError("tc not found")
        if sh("ip", "-n", d.ns, "link", "show", self.MDNS_SINK, check=False).returncode != 0:
            sh("ip", "-n", d.ns, "link", "add", self.MDNS_SINK, "type", "veth", "peer", "name", f"{self.MDNS_SINK}1")
            sh("ip", "-n", d.ns, "link", "set", self.MDNS_SINK, "up")
        sh("tc", "-n", d.ns, "qdisc", "replace", "dev", d.link, "clsact")
        for hook in ("ingress", "egress"):
            sh("tc", "-n", d.ns, "filter", "add", "dev", d.link, hook, "protocol", "ip", "u32",
               "match", "ip", "protocol", "17", "0xff", "match", "ip", "dport", "5353", "0xffff",
               "action", "mirred", "egress", "redirect", "dev", self.MDNS_SINK)

    def allow_mdns(self, d: Daemon) -> None:
        """Undo :meth:`drop_mdns`."""
        sh("tc", "-n", d.ns, "qdisc", "del", "dev", d.link, "clsact", check=False)

    def kill(self, d: Daemon) -> None:
        """SIGKILL daemon ``d`` (no goodbye, no leave: its peers learn it from heartbeats)."""
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(timeout=10)

    def _link_cmd(self, i: int, side: str) -> list[str]:
        if side == "hub":
            return ["ip", "-n", self.hub, "link", "set", self.hub_veth(i)]
        if side == "node":
            return ["ip", "-n", self.node_ns(i), "link", "set", self.daemons[i].link]
        raise ValueError(f"side must be 'hub' or 'node', not {side!r}")

    # --- daemons ------------------------------------------------------------------------

    def command(self, d: Daemon) -> list[str]:
        """The full command line that starts daemon ``d`` inside its namespace."""
        where = (["--host", "0.0.0.0", "--api-host", "0.0.0.0"] if d.wildcard  # noqa: S104 - as a user would
                 else ["--host", d.ip, "--api-host", d.ip, "--interface", d.ip])
        return ["ip", "netns", "exec", d.ns, sys.executable, "-m", "ringlet.daemon.ops.cli", "run",
                *where, "--port", str(GRPC_PORT), "--api-port", str(API_PORT),
                "--cluster", self.cluster, "--data-dir", str(d.data_dir), *d.args]

    def start(self, d: Daemon) -> None:
        """Spawn daemon ``d`` (returns at once; see :meth:`wait_healthy`)."""
        if d.alive():
            raise RuntimeError(f"node {d.index} already runs")
        log = open(d.log_path, "a")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        # `ip netns exec` execs the command: the pid is the daemon's own
        d.proc = subprocess.Popen(self.command(d), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1", **d.env), start_new_session=True)

    def stop(self, d: Daemon, timeout_s: float = 10.0) -> None:
        """SIGTERM daemon ``d``, SIGKILL after ``timeout_s``."""
        if d.proc is None or d.proc.poll() is not None:
            return
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(timeout=10)

    def start_all(self, n: int, args: list[str] | None = None, timeout_s: float = 120.0) -> list[Daemon]:
        """Create ``n`` nodes, start them all, and wait until each answers ``/healthz``."""
        return self.start_nodes([self.add_node(args) for _ in range(n)], timeout_s)

    def start_nodes(self, nodes: list[Daemon], timeout_s: float = 120.0) -> list[Daemon]:
        """Start ``nodes`` (made by :meth:`add_node`) and wait until each answers ``/healthz``."""
        for d in nodes:
            self.start(d)
        deadline = time.monotonic() + timeout_s
        for d in nodes:
            self.wait_healthy(d, deadline)
        return nodes

    def wait_healthy(self, d: Daemon, deadline: float) -> None:
        while True:
            if d.proc.poll() is not None:
                raise RuntimeError(f"node {d.index} exited with {d.proc.returncode}:\n{d.tail()}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if self.get(d, "/healthz", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {d.index} not healthy in time:\n{d.tail()}")
            time.sleep(0.2)

    # --- talking to daemons from the hub namespace ----------------------------------------

    def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` in a thread inside the hub namespace; return its result."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self.hub}-", initializer=_setns,
                initargs=(f"/var/run/netns/{self.hub}",))
        return self._pool.submit(fn, *args, **kwargs).result()

    def _http(self) -> httpx.Client:
        # created (and its connections opened) in the hub thread only
        if self._client is None:
            self._client = httpx.Client(trust_env=False)
        return self._client

    def get(self, d: Daemon, path: str, timeout: float = 5.0) -> httpx.Response:
        return self.call(lambda: self._http().get(f"{d.api_url}{path}", timeout=timeout))

    def post(self, d: Daemon, path: str, body: dict, timeout: float = 300.0) -> httpx.Response:
        return self.call(lambda: self._http().post(f"{d.api_url}{path}", json=body, timeout=timeout))

    def cluster_info(self, d: Daemon, timeout: float = 3.0) -> dict:
        """``GET /v1/cluster`` of daemon ``d``."""
        resp = self.get(d, "/v1/cluster", timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def node_records(self, nodes: list[Daemon], timeout: float = 3.0) -> dict[int, dict]:
        """Each daemon's own record (its measured links, per direction) over gRPC ``GetNodeInfo``:
        ``{index: {"node_id", "record_version", "record"}}``.

        The gRPC client runs in a child process inside the hub namespace (``ip netns exec``):
        gRPC's own I/O threads must not be shared across namespaces.
        """
        out = sh("ip", "netns", "exec", self.hub, sys.executable, "-c", _RECORDS_SCRIPT, str(timeout),
                 *(d.grpc_address for d in nodes), timeout=30 + timeout * len(nodes)).stdout
        got = json.loads(out)
        return {d.index: got[d.grpc_address] for d in nodes}

    def views(self, nodes: list[Daemon] | None = None) -> dict[int, dict | str]:
        """``/v1/cluster`` of each node (or the error text when it does not answer)."""
        out: dict[int, dict | str] = {}
        for d in nodes if nodes is not None else self.daemons:
            try:
                out[d.index] = self.cluster_info(d)
            except (httpx.HTTPError, ValueError, OSError) as exc:
                out[d.index] = repr(exc)
        return out

    def wait_converged(self, nodes: list[Daemon] | None = None, stages: int | None = None,
                       timeout_s: float = 60.0, min_epoch: int = 1,
                       extra: Callable[[dict[int, dict]], bool] | None = None) -> dict[int, dict]:
        """Wait until every one of ``nodes`` (default: all) lists exactly those nodes as
        members and all have committed one plan (same epoch and plan id; ``stages``
        stages when given; ``extra(views)`` true when given). Returns the views.

        Raises:
            AssertionError: not reached in time (the last views are summarised).
        """
        nodes = nodes if nodes is not None else self.daemons
        deadline = time.monotonic() + timeout_s
        views: dict = {}
        while True:
            views = self.views(nodes)
            if all(isinstance(v, dict) for v in views.values()):
                ids = {v["node_id"] for v in views.values()}
                members_ok = all({m["node_id"] for m in v.get("members", [])} == ids
                                 and all(m["state"] in ("self", "alive") for m in v.get("members", []))
                                 for v in views.values())
                plans = {(v["epoch"], v.get("plan_id")) for v in views.values()}
                first = next(iter(views.values()))
                if (members_ok and len(plans) == 1 and first["epoch"] >= min_epoch and first.get("plan")
                        and (stages is None or len(first["plan"]) == stages)
                        and (extra is None or extra(views))):
                    return views
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes {[d.index for d in nodes]} did not converge in {timeout_s:.0f} s: "
                                     f"{summarise(views)}")
            time.sleep(0.25)

    def index_of(self, node_id: str) -> Daemon:
        for d in self.daemons:
            v = self.views([d])[d.index]
            if isinstance(v, dict) and v["node_id"] == node_id:
                return d
        raise LookupError(f"no daemon answers as {node_id}")

    # --- teardown -----------------------------------------------------------------------

    def dump_logs(self, lines: int = 40) -> str:
        return "\n".join(f"----- node {d.index} ({d.ns}, {d.ip}) -----\n{d.tail(lines)}" for d in self.daemons)

    def close(self) -> None:
        """Stop every daemon, delete every namespace (veths and bridge go with them)."""
        for d in self.daemons:
            if d.alive():
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            with contextlib.suppress(Exception):
                self.stop(d, timeout_s=8.0)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self.call(self._client.close)
            self._client = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for ns in reversed(self._namespaces):
            _kill_namespace_pids(ns)  # anything of ours still inside
            sh("ip", "netns", "delete", ns, check=False)
        self._namespaces.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_RECORDS_SCRIPT = """
import json, sys
import grpc
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb, ringlet_pb2_grpc as pb_grpc
timeout, out = float(sys.argv[1]), {}
for address in sys.argv[2:]:
    with grpc.insecure_channel(address) as ch:
        info = pb_grpc.RingStub(ch).GetNodeInfo(pb.NodeInfoRequest(), timeout=timeout)
    out[address] = {"node_id": info.node_id, "record_version": info.record_version,
                    "record": json.loads(info.record_json) if info.record_json else {}}
print(json.dumps(out))
"""


def summarise(views: dict) -> list:
    """Short per-node summary of ``views`` for assertion messages."""
    out = []
    for i, v in views.items():
        if not isinstance(v, dict):
            out.append((i, v))
            continue
        negotiation = v.get("negotiation") or {}
        out.append((i, v.get("node_id"), f"epoch {v.get('epoch')}", f"{len(v.get('plan') or [])} stages",
                    sorted((m["node_id"][:8], m["state"]) for m in v.get("members", [])),
                    f"negotiation {negotiation.get('state')!r}, last {negotiation.get('last_result')!r}"))
    return out
