"""``ringlet demo``: a local cluster of N daemons on loopback, one question, then stop.

:class:`LocalCluster` starts real ``ringlet run`` processes (each its own gRPC and
API port on 127.0.0.1, a static even plan) and stops them all; tests and the
benchmark use it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ringlet.daemon.cluster.static_plan import even_plan
from ringlet.daemon.engine.model_info import model_info
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.errors import RingletError
from ringlet.daemon.wire.ports import free_ports

__all__ = ["LocalCluster", "free_ports", "run_demo"]




class LocalCluster:
    """``ringlet run`` processes on 127.0.0.1: a static even plan, or (``dynamic``) a
    cluster that forms by mDNS on loopback and negotiates its plans.

    Args:
        nodes: number of daemons to start.
        model: model path or short name (default model when ``None``).
        dtype: optional ``--dtype``.
        extra_args: more ``ringlet run`` arguments for every node.
        per_node_args: more ``ringlet run`` arguments for node i (after ``extra_args``).
        ranges: explicit ``[(start, end), ...]`` instead of the even split (static mode).
        dynamic: no ``--plan``: discovery (mDNS on 127.0.0.1 only) and negotiation;
            each node gets its own data dir; nodes can be added, killed and restarted.
        cluster_name: the ``--cluster`` of a dynamic cluster (default: unique per instance).
        env: extra environment of every node (``add_node`` can add more per node).
        per_node_env: more environment of node i (after ``env``).
    """

    def __init__(self, nodes: int, model: str | None = None, dtype: str | None = None,
                 extra_args: list[str] | None = None, ranges: list[tuple[int, int]] | None = None,
                 log_dir: str | None = None, per_node_args: list[list[str]] | None = None,
                 dynamic: bool = False, cluster_name: str | None = None, env: dict[str, str] | None = None,
                 per_node_env: list[dict[str, str]] | None = None):
        self.n = nodes
        self.per_node_args = per_node_args or [[] for _ in range(nodes)]
        self.model = model
        self.dtype = dtype
        self.extra_args = extra_args or []
        self.ranges = ranges
        self.dynamic = dynamic
        self.cluster_name = cluster_name or f"test-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.procs: list[subprocess.Popen] = []
        self.grpc_ports: list[int] = []
        self.api_ports: list[int] = []
        self.plan_text = ""
        self._log_dir = log_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._logs: list = []
        self._env: dict[int, dict[str, str]] = dict(enumerate(per_node_env or []))
        self._common_env = dict(env or {})
        self._node_models: dict[int, str] = {}  # add_node(model=...): another model than the others'

        #: Headers of the API calls made here (e.g. ``Authorization`` when nodes have ``--api-key-file``).
        self.api_headers: dict[str, str] = {}

    @property
    def api_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.api_ports]

    def log_path(self, i: int) -> Path:
        return Path(self._log_dir) / f"node{i}.log"

    def data_dir(self, i: int) -> Path:
        return Path(self._log_dir) / f"data{i}"

    def _command(self, i: int) -> list[str]:
        cmd = [sys.executable, "-m", "ringlet.daemon.ops.cli", "run", "--port", str(self.grpc_ports[i]),
               "--api-port", str(self.api_ports[i])]
        if self.dynamic:
            cmd += ["--interface", "127.0.0.1", "--cluster", self.cluster_name, "--data-dir", str(self.data_dir(i))]
        else:
            cmd += ["--plan", self.plan_text, "--data-dir", str(self.data_dir(i))]
        model = self._node_models.get(i, self.model)
        if model:
            cmd += ["--model", model]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        extra = self.per_node_args[i] if i < len(self.per_node_args) else []
        return cmd + self.extra_args + extra

    def _spawn(self, i: int) -> None:
        log = open(self.log_path(i), "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self._common_env, **self._env.get(i, {}))
        proc = subprocess.Popen(self._command(i), stdout=log, stderr=subprocess.STDOUT,  # noqa: S603 - argv of this Python and ringlet flags, no shell
                                env=env, start_new_session=True)
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def _wait_healthy(self, i: int, deadline: float) -> None:
        url = self.api_urls[i]
        while True:
            if self.procs[i].poll() is not None:
                code, tail = self.procs[i].returncode, self.tail(i)
                self.stop()
                raise RingletError(f"node {i} exited with {code}:\n{tail}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self.tail(i)
                self.stop()
                raise RingletError(f"node {i} not ready in time:\n{tail}")
            time.sleep(0.1)

    def start(self, timeout_s: float = 180.0, stages: int | None = None) -> LocalCluster:
        """Start every node and wait until all serve (dynamic: until all have
        committed one plan of ``stages`` stages, default one per node).

        Raises:
            RingletError: a node exited or did not become ready in time (its log tail is
                included); every node started is stopped first.
        """
        if self._log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ringlet-demo-")
            self._log_dir = self._tmp.name
        ports = free_ports(2 * self.n)
        self.grpc_ports, self.api_ports = ports[: self.n], ports[self.n:]
        if not self.dynamic:
            info = model_info(resolve(self.model))
            addresses = [f"127.0.0.1:{p}" for p in self.grpc_ports]
            if self.ranges:
                stages = [f"{a}={s}:{e}" for a, (s, e) in zip(addresses, self.ranges, strict=True)]
            else:
                stages = [f"{s.address}={s.start}:{s.end}" for s in even_plan(addresses, info.num_layers)]
            self.plan_text = ",".join(stages)
        try:
            for i in range(self.n):
                self._spawn(i)
            deadline = time.monotonic() + timeout_s
            for i in range(self.n):
                self._wait_healthy(i, deadline)
            if self.dynamic:
                self.wait_plan(stages=stages or self.n, timeout_s=max(5.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()  # nothing it started outlives a failed start
            raise
        return self

    def add_node(self, extra_args: list[str] | None = None, wait: bool = True, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, model: str | None = None) -> int:
        """Start one more node of a dynamic cluster (``env``: extra environment; ``model``:
        its ``--model`` instead of the cluster's, as a repeated ``--model`` serves several
        models); returns its index."""
        i = len(self.procs)
        if model is not None:
            self._node_models[i] = model
        self._env[i] = dict(env or {})
        grpc_port, api_port = free_ports(2)
        self.grpc_ports.append(grpc_port)
        self.api_ports.append(api_port)
        while len(self.per_node_args) <= i:
            self.per_node_args.append([])
        self.per_node_args[i] = list(extra_args or [])
        self._spawn(i)
        if wait:
            self._wait_healthy(i, time.monotonic() + timeout_s)
        return i

    def restart(self, i: int, wait: bool = True, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> None:
        """Start node ``i`` again (same ports and data dir) after it stopped; ``env``, when
        given, replaces its extra environment (e.g. another build's ``PYTHONPATH``)."""
        if self.procs[i].poll() is None:
            raise RingletError(f"node {i} is still running")
        if env is not None:
            self._env[i] = dict(env)
        self._spawn(i)
        if wait:
            self._wait_healthy(i, time.monotonic() + timeout_s)

    def alive(self) -> list[int]:
        """Indices of the nodes whose process runs."""
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def cluster_info(self, i: int) -> dict:
        """``GET /v1/cluster`` of node ``i``."""
        return httpx.get(f"{self.api_urls[i]}/v1/cluster", timeout=5, headers=self.api_headers).json()

    def wait_plan(self, stages: int | None = None, timeout_s: float = 60.0, nodes: list[int] | None = None,
                  min_epoch: int = 1) -> dict:
        """Wait until every running node (or ``nodes``) has committed the same plan
        (epoch >= ``min_epoch``, with ``stages`` stages when given). Returns node 0's
        (or the first given node's) ``/v1/cluster``.

        Raises:
            RingletError: not reached in time (the last views are included).
        """
        nodes = nodes if nodes is not None else self.alive()
        deadline = time.monotonic() + timeout_s
        views: list = []
        while time.monotonic() < deadline:
            try:
                views = [self.cluster_info(i) for i in nodes]
            except (httpx.HTTPError, ValueError):
                time.sleep(0.2)
                continue
            keys = {(v["epoch"], v.get("plan_id")) for v in views}
            first = views[0]
            if (len(keys) == 1 and first["epoch"] >= min_epoch and first.get("plan")
                    and (stages is None or len(first["plan"]) == stages)):
                return first
            time.sleep(0.2)
        summary = [(v.get("node_id"), v.get("epoch"), v.get("plan_id"), len(v.get("plan") or [])) for v in views]
        raise RingletError(f"no common plan{f' of {stages} stages' if stages else ''} within {timeout_s:.0f} s: "
                           f"{summary}")

    def tail(self, i: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(i).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to node ``i`` and reap it; SIGKILL goes to its whole process group
        (a node serving several models runs one child per model: a lost machine loses all)."""
        if self.procs[i].poll() is None:
            if sig == signal.SIGKILL:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.procs[i].pid, sig)
            else:
                self.procs[i].send_signal(sig)
            self.procs[i].wait(timeout=30)

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 10 s)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):  # a child it left (a model's lane)
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._log_dir is not None:
            self.print_log_tails()
        self.stop()

    def print_log_tails(self, lines: int = 40) -> None:
        """Print the last ``lines`` lines of every node's log to stdout (the cluster is
        leaving on an error: the logs say what the nodes saw; pytest shows them with
        the failure)."""
        for i in range(len(self.procs)):
            path = self.log_path(i)
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                print(f"--- node {i} ({path.name}), last {len(tail)} lines ---", *tail, sep="\n")


def run_demo(nodes: int, question: str, model: str | None, dtype: str | None) -> int:
    """Start ``nodes`` daemons, ask ``question`` through node 0's API, print the answer and plan."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if nodes < 1:
        raise RingletError("--nodes must be at least 1")
    with console.status(f"starting {nodes} ringlet daemons on 127.0.0.1; they find each other over mDNS "
                        "and agree on a plan ..."):
        cluster = LocalCluster(nodes, model=model, dtype=dtype, dynamic=True).start()
    try:
        plan = httpx.get(f"{cluster.api_urls[0]}/v1/cluster", timeout=10).json()
        table = Table(title=f"plan (epoch {plan['epoch']}): {plan['model']}, {plan['num_layers']} layers")
        for col in ("stage", "node", "gRPC", "layers [start, end)"):
            table.add_column(col)
        for i, stage in enumerate(plan["plan"]):
            table.add_row(str(i), stage.get("node_id") or "-", stage["address"], f"[{stage['start']}, {stage['end']})")
        console.print(table)
        console.print(f"[bold]user:[/bold] {question}")
        t0 = time.perf_counter()
        resp = httpx.post(f"{cluster.api_urls[0]}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0})
        if resp.status_code != 200:
            raise RingletError(f"the cluster answered {resp.status_code}: {resp.text[:300]}")
        body = resp.json()
        answer = body["choices"][0]["message"]["content"]
        elapsed = time.perf_counter() - t0
        console.print(f"[bold]assistant:[/bold] {answer}")
        usage = body["usage"]
        console.print(f"[dim]{usage['completion_tokens']} tokens in {elapsed:.2f} s through "
                      f"{nodes} stages; finish_reason={body['choices'][0]['finish_reason']}[/dim]")
    finally:
        with console.status("stopping the daemons ..."):
            cluster.stop()
    return 0
