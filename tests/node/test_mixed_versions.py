"""Two real builds in one ring: release 0.1.0, built from this repository's history
(:mod:`oldbuild`), beside the current build, both orders of node ids.

Every answer equals the independent reference (transformers, float32, greedy), whichever
node takes the request; stage 0 drafts only where every stage verifies and trims (a
0.1.0 node does not: the plan's features leave drafts out), so a request with a
``prediction`` is answered without it, never failed. Stage 0 drafts whenever it can
(``RINGLET_TEST_SPEC_ALWAYS``), so a draft that reached a 0.1.0 stage would show.
"""

from __future__ import annotations

import oldbuild
import pytest
from oldbuild import CHAT, RAW, TOKENS, chat, complete, ring

from ringlet.daemon.wire import versions


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    build = oldbuild.release(oldbuild.RELEASE_0_1_0, tmp_path_factory.mktemp("release-0.1.0"), "0.1.0")
    assert oldbuild.imported_from(build) == str(build.tree / "daemon")  # the old code runs, not the editable install
    return build


@pytest.mark.parametrize("head", ["old", "new"])
def test_two_releases_in_one_ring(old, tmp_path, head):
    builds = [old, None] if head == "old" else [None, old]
    with ring(tmp_path, builds, ["a0", "b1"]) as c:
        view = c.wait_plan(stages=2, timeout_s=90)
        assert [s["node_id"] for s in view["plan"]] == ["a0", "b1"]  # node 0 is stage 0
        new = builds.index(None)
        info = c.cluster_info(new)
        assert info["plan_features"] == [], info["plan_features"]  # the 0.1.0 node speaks the baseline alone
        for i in (0, 1):  # every node takes requests: as the head's API node and as a remote one
            for stream in (False, True):
                assert complete(c.api_urls[i], stream).ids == RAW["completion_ids"][:TOKENS], (i, stream)
        answer = chat(c.api_urls[new], True)  # release 0.1.0 refuses the field itself (400): asked of the new node
        assert answer["choices"][0]["token_ids"] == CHAT["completion_ids"]
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0  # answered without it
        if head == "new":
            spec = c.cluster_info(0)["speculation"]
            assert spec["trips"] == 0 and spec["off"].get("versions", 0) > 0, spec
        members = {m["node_id"]: m for m in info["members"]}
        assert members["a0" if head == "old" else "b1"]["release"] == "0.1.0"
        assert members["b1" if head == "old" else "a0"]["release"] == versions.RELEASE
