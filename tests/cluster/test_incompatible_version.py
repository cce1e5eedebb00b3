"""A node of another wire protocol version is kept out, with the reason, and the rest serve.

The other build is a copy of the current tree with ``PROTOCOL_VERSION`` raised to 2 (and
its release named 0.3.0), run as a real daemon beside two current ones (:mod:`oldbuild`),
with the lowest node id, so that admitted it would propose every plan. Each side finds the
other by mDNS on loopback; the handshake refuses it, and ``/v1/cluster``, the events and
``ringlet status`` say so, naming both versions and the node to upgrade.
"""

from __future__ import annotations

import json
import time

import oldbuild
import pytest
from conftest import ringlet
from oldbuild import CHAT, RAW, TOKENS, chat, complete, ring

from ringlet.daemon.wire import versions


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"{what} not within {timeout_s} s (last: {last})")


def test_a_node_of_another_protocol_version_is_kept_out_with_the_reason(tmp_path):
    raised = oldbuild.patched_current(tmp_path / "raised", "protocol 2", {"daemon/wire/versions.py": (
        "PROTOCOL_VERSION: int = 1", "PROTOCOL_VERSION: int = 2")})
    text = (raised.tree / "daemon/wire/versions.py").read_text().replace("RELEASE: str = _release()",
                                                                         'RELEASE: str = "0.3.0"')
    (raised.tree / "daemon/wire/versions.py").write_text(text)
    with ring(tmp_path / "ring", [None, None], ["b1", "c2"]) as c:
        c.wait_plan(stages=2, timeout_s=60)
        (tmp_path / "ring" / "data2").mkdir()
        (tmp_path / "ring" / "data2" / "node.json").write_text(json.dumps({"node_id": "a0", "created_at": 1.0}))
        other = c.add_node(env=raised.env)
        assert c.cluster_info(other)["protocol_version"] == 2  # the raised build runs

        out = wait_for(lambda: c.cluster_info(0).get("incompatible"), 30, "the raised node kept out")
        assert [(x["node_id"], x["release"], x["protocol_version"]) for x in out] == [("a0", "0.3.0", 2)]
        reason = out[0]["reason"]
        assert "protocol 2" in reason and f"protocol {versions.PROTOCOL_VERSION}" in reason, reason
        assert "upgrade this node" in reason and "or keep a0 on an older release" in reason, reason
        theirs = wait_for(lambda: c.cluster_info(other).get("incompatible"), 30, "the current nodes kept out there")
        assert {x["node_id"] for x in theirs} == {"b1", "c2"}
        assert all("upgrade b1" in x["reason"] or "upgrade c2" in x["reason"] for x in theirs), theirs

        for i in (0, 1):  # the others serve, on their own plan, with every feature
            info = c.cluster_info(i)
            assert sorted(m["node_id"] for m in info["members"]) == ["b1", "c2"]
            assert [s["node_id"] for s in info["plan"]] == ["b1", "c2"]
            assert info["plan_features"] == sorted(versions.CAPABILITIES)
            assert complete(c.api_urls[i], stream=i == 1).ids == RAW["completion_ids"][:TOKENS]
        answer = chat(c.api_urls[0], True)  # two current nodes: drafts (the prediction's)
        assert answer["choices"][0]["token_ids"] == CHAT["completion_ids"]
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        events = [e for e in c.cluster_info(0)["events"] if e["kind"] == "incompatible"]
        assert len(events) == 1 and "a0" in events[0]["message"], events

        status = ringlet("status", "--api", c.api_urls[0], timeout=60)
        assert status.returncode == 0, status.stderr
        assert f"kept out: {reason}" in status.stdout, status.stdout
        assert f"{versions.RELEASE}/p{versions.PROTOCOL_VERSION}" in status.stdout, status.stdout
