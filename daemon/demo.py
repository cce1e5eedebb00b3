"""``ringlet demo``: a local cluster of N daemons on loopback, one question, then stop.

:class:`LocalCluster` starts real ``ringlet run`` processes (each its own gRPC and
API port on 127.0.0.1, a static even plan) and stops them all; tests and the
benchmark use it too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .errors import RingletError
from .model_info import model_info
from .sources import resolve
from .static_plan import even_plan


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class LocalCluster:
    """N ``ringlet run`` processes on 127.0.0.1 with an even static plan.

    Args:
        nodes: number of daemons (pipeline stages).
        model: model path or short name (default model when ``None``).
        dtype: optional ``--dtype``.
        extra_args: more ``ringlet run`` arguments for every node.
        per_node_args: more ``ringlet run`` arguments for node i (after ``extra_args``).
        ranges: explicit ``[(start, end), ...]`` instead of the even split.
    """

    def __init__(self, nodes: int, model: str | None = None, dtype: str | None = None,
                 extra_args: list[str] | None = None, ranges: list[tuple[int, int]] | None = None,
                 log_dir: str | None = None, per_node_args: list[list[str]] | None = None):
        self.n = nodes
        self.per_node_args = per_node_args or [[] for _ in range(nodes)]
        self.model = model
        self.dtype = dtype
        self.extra_args = extra_args or []
        self.ranges = ranges
        self.procs: list[subprocess.Popen] = []
        self.grpc_ports: list[int] = []
        self.api_ports: list[int] = []
        self.plan_text = ""
        self._log_dir = log_dir
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def api_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.api_ports]

    def log_path(self, i: int) -> Path:
        return Path(self._log_dir) / f"node{i}.log"

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        """Start every node and wait until all report ready.

        Raises:
            RingletError: a node exited or did not become ready in time (its log tail is included).
        """
        location = resolve(self.model)
        info = model_info(location)
        ports = free_ports(2 * self.n)
        self.grpc_ports, self.api_ports = ports[: self.n], ports[self.n:]
        addresses = [f"127.0.0.1:{p}" for p in self.grpc_ports]
        if self.ranges:
            stages = [f"{a}={s}:{e}" for a, (s, e) in zip(addresses, self.ranges, strict=True)]
        else:
            stages = [f"{s.address}={s.start}:{s.end}" for s in even_plan(addresses, info.num_layers)]
        self.plan_text = ",".join(stages)
        if self._log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ringlet-demo-")
            self._log_dir = self._tmp.name
        exe = [sys.executable, "-m", "ringlet.daemon.cli"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for i in range(self.n):
            cmd = exe + ["run", "--port", str(self.grpc_ports[i]), "--api-port", str(self.api_ports[i]),
                         "--plan", self.plan_text]
            if self.model:
                cmd += ["--model", self.model]
            if self.dtype:
                cmd += ["--dtype", self.dtype]
            cmd += self.extra_args + self.per_node_args[i]
            log = open(self.log_path(i), "w")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
        deadline = time.monotonic() + timeout_s
        for i, url in enumerate(self.api_urls):
            while True:
                if self.procs[i].poll() is not None:
                    code, tail = self.procs[i].returncode, self.tail(i)
                    self.stop()
                    raise RingletError(f"node {i} exited with {code}:\n{tail}")
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    tail = self.tail(i)
                    self.stop()
                    raise RingletError(f"node {i} not ready after {timeout_s:.0f} s:\n{tail}")
                time.sleep(0.1)
        return self

    def tail(self, i: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(i).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to node ``i``."""
        if self.procs[i].poll() is None:
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
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_demo(nodes: int, question: str, model: str | None, dtype: str | None) -> int:
    """Start ``nodes`` daemons, ask ``question`` through node 0's API, print the answer and plan."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if nodes < 1:
        raise RingletError("--nodes must be at least 1")
    with console.status(f"starting {nodes} ringlet daemons on 127.0.0.1 ..."):
        cluster = LocalCluster(nodes, model=model, dtype=dtype).start()
    try:
        plan = httpx.get(f"{cluster.api_urls[0]}/v1/cluster", timeout=10).json()
        table = Table(title=f"plan (epoch {plan['epoch']}): {plan['model']}, {plan['num_layers']} layers")
        for col in ("stage", "node", "layers [start, end)", "API"):
            table.add_column(col)
        for i, stage in enumerate(plan["plan"]):
            table.add_row(str(i), stage["address"], f"[{stage['start']}, {stage['end']})", cluster.api_urls[i])
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
