"""A rolling upgrade under a steady client: 3 daemons of release 0.1.0 (built from this
repository's history, :mod:`oldbuild`) replaced by the current build one at a time, each
stopped gracefully (``SIGTERM``: it drains and leaves) and started again on the same data
dir and ports, while two clients (one streaming, one not) send requests one after another.

Zero requests fail and every answer equals the undisturbed ring's (which equals the
independent reference); the ring drafts again once every node runs the current build.
The longest gap between two streamed tokens and the failures are printed.
"""

from __future__ import annotations

import signal
import threading
import time

import oldbuild
from oldbuild import CHAT, RAW, TOKENS, chat, complete, ring

from ringlet.daemon.wire import versions


class SteadyClient:
    """Requests one after another to the API of node :attr:`target` (switched by the test
    away from a node before it is stopped, as a load balancer would), streamed or not, until
    :meth:`stop`; every answer is checked against ``expected``."""

    def __init__(self, cluster, expected: list[int], stream: bool, target: int):
        self.cluster, self.expected, self.stream, self.target = cluster, expected, stream, target
        self.answers = 0
        self.failed: list[str] = []
        self.max_gap_s = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            target = self.target
            try:
                got = complete(self.cluster.api_urls[target], self.stream)
            except (AssertionError, Exception) as exc:  # noqa: BLE001 - every failure is counted
                self.failed.append(f"node {target}: {str(exc)[:300]}")
                time.sleep(0.2)
                continue
            self.answers += 1
            self.max_gap_s = max(self.max_gap_s, got.max_gap_s)
            if got.ids != self.expected:
                self.failed.append(f"node {target}: {got.ids} != {self.expected}")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(150)
        assert not self.thread.is_alive(), "a request did not end"


def test_rolling_upgrade_from_0_1_0_serves_throughout(tmp_path):
    old = oldbuild.release(oldbuild.RELEASE_0_1_0, tmp_path / "release", "0.1.0")
    with ring(tmp_path / "ring", [old, old, old], ["a0", "b1", "c2"]) as c:
        c.wait_plan(stages=3, timeout_s=90)
        undisturbed = complete(c.api_urls[2], False).ids
        assert undisturbed == RAW["completion_ids"][:TOKENS]
        clients = [SteadyClient(c, undisturbed, stream, target=2) for stream in (True, False)]
        t0 = time.monotonic()
        for i in (0, 1, 2):  # stage 0 (and the proposer) first: a current stage 0 before 0.1.0 stages
            if i == 2:
                for client in clients:
                    client.target = 0
            c.kill(i, signal.SIGTERM)  # drains, leaves
            c.restart(i, env={})  # the current build, same data dir and ports
            c.wait_plan(stages=3, timeout_s=60)
        done = [client.answers for client in clients]
        while any(client.answers < n + 1 for client, n in zip(clients, done, strict=True)):
            time.sleep(0.1)  # an answer of each from the upgraded ring
        for client in clients:
            client.stop()
        took = time.monotonic() - t0
        answers = sum(client.answers for client in clients)
        failed = [f for client in clients for f in client.failed]
        gap = clients[0].max_gap_s
        print(f"rolling upgrade of 3 daemons 0.1.0 -> {versions.RELEASE} in {took:.1f} s: {answers} answers, "
              f"{len(failed)} failed, longest token gap {gap:.2f} s")
        assert not failed, failed
        assert all(client.answers >= 3 for client in clients), [client.answers for client in clients]
        info = c.cluster_info(0)
        assert {m["release"] for m in info["members"]} == {versions.RELEASE}
        assert info["plan_features"] == sorted(versions.CAPABILITIES)
        answer = chat(c.api_urls[1], True)  # every node current: drafts on (the prediction's)
        assert answer["choices"][0]["token_ids"] == CHAT["completion_ids"]
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
