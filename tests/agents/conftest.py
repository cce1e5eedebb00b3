"""Fixtures of the coding-agent tests: one 2-daemon ring for all of them, a capture proxy
in front of its first node, and a sandbox (home, XDG dirs, project) per test. Without the
CLIs (``make agents`` installs them with npm) every test skips, saying why."""

from __future__ import annotations

import pytest
from agent_harness import CaptureProxy, Sandbox, missing_clients

from ringlet.daemon.ops.demo import LocalCluster


@pytest.fixture(scope="session")
def ring():
    """A float32 ring of two daemons, started once for every agent test."""
    if reason := missing_clients():
        pytest.skip(reason)
    cluster = LocalCluster(2, dtype="float32").start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def proxy(ring):
    """The capture proxy the clients talk to, in front of the ring's first node."""
    p = CaptureProxy(ring.api_urls[0]).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def sandbox(tmp_path):
    """An isolated home and project for one test's client runs."""
    return Sandbox(tmp_path)
