"""The dashboard and ``ringlet status`` on a real 3-daemon cluster (one per module):
``--once`` at 80 and 160 columns, status JSON, and a live dashboard in tmux watching the
tokens/s change while a long generation runs."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rich.console import Console

from ringlet.daemon.ops.dashboard.events import EventTracker
from ringlet.daemon.ops.dashboard.frame import render
from ringlet.daemon.ops.demo import LocalCluster
from ringlet.daemon.ops.status.collector import take_snapshot


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(3) as c:
        yield c


def truth(cluster) -> list[dict]:
    """Each node's own ``/v1/cluster``."""
    return [httpx.get(f"{u}/v1/cluster", timeout=10).json() for u in cluster.api_urls]


def api_args(cluster) -> list[str]:
    return [a for u in cluster.api_urls for a in ("--api", u)]


def stage_line(lines: list[str], stage: int) -> str:
    found = [ln for ln in lines if re.match(rf"^\s?{stage} \S", ln)]
    assert found, f"stage {stage} not drawn:\n" + "\n".join(lines)
    return found[0]


def check_frame(text: str, infos: list[dict], width: int) -> None:
    lines = text.splitlines()
    assert all(len(ln) <= width for ln in lines), f"a line is wider than {width}"
    assert f"epoch {infos[0]['epoch']}" in lines[0]
    for info in infos:
        start, end = info["layer_range"]
        line = stage_line(lines, info["stage"])
        assert f"[{start}, {end})" in line, line
        assert info["node_id"][:8] in line or info["address"] in line, line


@pytest.mark.parametrize("width", [80, 160])
def test_dashboard_once_shows_every_node_with_its_range_and_the_epoch(cluster, width):
    infos = truth(cluster)
    env = dict(os.environ, COLUMNS=str(width), LINES="50")
    r = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "dashboard", "--once", *api_args(cluster)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    check_frame(r.stdout, infos, width)


def test_rendered_in_process_at_80_and_160_columns(cluster):
    infos = truth(cluster)
    snap = EventTracker().observe(take_snapshot(cluster.api_urls))
    for width in (80, 160):
        console = Console(record=True, width=width, file=io.StringIO())
        console.print(render(snap))
        check_frame(console.export_text(), infos, width)
    # with only the first node's URL, the plan still draws all three stages
    snap = take_snapshot(cluster.api_urls[:1])
    assert [n["layer_range"] for n in snap["nodes"]] == [i["layer_range"] for i in infos]


def test_status_json_equals_the_cluster(cluster):
    infos = truth(cluster)
    r = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "status", "--json", *api_args(cluster)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    snap = json.loads(r.stdout)
    assert snap["healthy"] and snap["cluster"]["epoch"] == infos[0]["epoch"]
    by_addr = {n["address"]: n for n in snap["nodes"]}
    for info in infos:
        node = by_addr[info["address"]]
        assert node["layer_range"] == info["layer_range"] and node["stage"] == info["stage"]
        assert node["state"] == info["state"] and node["reachable"] is True


def _stream_completion(url: str, first: threading.Event, stop: threading.Event, errors: list) -> None:
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 150, "stream": True,
            "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    first.set()
                if stop.is_set():
                    break
    except Exception as exc:  # reported by the test
        errors.append(exc)
    finally:
        first.set()


HEADER = re.compile(r"in flight (\S+) · (\S+) tok/s")
SERVED = re.compile(r"([\d,]+) tokens served")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
def test_live_dashboard_in_tmux_sees_tokens_per_s_change(cluster):
    if "tokens_generated_total" not in truth(cluster)[0]:
        pytest.skip("the daemon's /v1/cluster has no tokens_generated_total counter yet (issue 6 asks for it)")
    sock = f"ringlet-dash-{os.getpid()}"
    cmd = [sys.executable, "-m", "ringlet.daemon.ops.cli", "dashboard", *api_args(cluster)]
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", "dash", "-x", "100", "-y", "32",
                    shlex.join(cmd)], check=True, timeout=30)
    stop, first, errors = threading.Event(), threading.Event(), []
    gen = threading.Thread(target=_stream_completion, args=(cluster.api_urls[0], first, stop, errors), daemon=True)

    def capture() -> str:
        return subprocess.run(["tmux", "-L", sock, "capture-pane", "-p", "-t", "dash"], capture_output=True,
                              text=True, timeout=10).stdout

    def wait_for(pred, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            pane = capture()
            if pred(pane) or time.monotonic() > deadline:
                return pane
            time.sleep(0.2)

    try:
        idle = wait_for(lambda p: HEADER.search(p) and "epoch" in p, 40)
        m = HEADER.search(idle)
        assert m, "the dashboard did not draw:\n" + idle
        assert m.group(1) == "0" and m.group(2) in ("0.0", "—"), idle
        gen.start()
        assert first.wait(60), "no token streamed"
        busy = wait_for(lambda p: (h := HEADER.search(p)) and h.group(2) not in ("0.0", "—"), 20)
        m1 = HEADER.search(busy)
        assert m1 and float(m1.group(2)) > 0, "tokens/s did not move while generating:\n" + busy
        assert m1.group(1) == "1"  # one request in flight
        time.sleep(1.0)
        later = capture()
        served = [int(SERVED.search(p).group(1).replace(",", "")) for p in (busy, later)]
        assert served[1] > served[0], "the token count did not advance between the two captures"
        assert not errors, errors
    finally:
        stop.set()
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, timeout=10)
        gen.join(timeout=60)
