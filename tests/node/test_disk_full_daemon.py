"""A real daemon whose data dir (and so its prefix store's disk tier) sits on a tiny
tmpfs filled to the brim while it serves: its answers stay those of the greedy
reference (tests/smollm2_135m_instruct_greedy.json, float32), the tier turns itself
off and ``/v1/cluster`` says so (the prefix store's ``disk.state``, an event), and the
daemon keeps serving.

The store's memory holds one request's entry (``--prefix-cache-bytes``), so the second
request evicts the first's entry to the disk tier, which cannot write it.
"""

from __future__ import annotations

import asyncio
import time
import types

import httpx
import pytest
from conftest import REFERENCE
from tinyfs import fill, tiny_fs

from ringlet.daemon.errors import NoPlanError
from ringlet.daemon.node.resume import ResumingClient
from ringlet.daemon.ops.demo import LocalCluster

RAW = next(c for c in REFERENCE if "raw" in c)
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # 30 layers of K and V, 3 KV heads of 64, float32


def complete(url: str, prompt: str, max_tokens: int) -> list[int]:
    resp = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_a_full_data_dir_turns_the_disk_tier_off_and_answers_stay_the_reference(tmp_path):
    args = ["--prefix-cache-bytes", str(40 * KV_BYTES_PER_TOKEN), "--prefix-cache-disk-bytes", "200MB"]
    with tiny_fs(tmp_path / "data0", "8m") as fs, LocalCluster(1, dtype="float32", log_dir=str(tmp_path),
                                                             extra_args=args) as c:
        url = c.api_urls[0]
        assert fill(fs) < 4096  # the daemon started (identity written), then the disk filled up
        first = complete(url, RAW["raw"], 24)
        assert first[:20] == RAW["completion_ids"][:20]
        complete(url, "The three primary colours are", 12)  # evicts the first entry: no room on disk
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = httpx.get(f"{url}/v1/cluster", timeout=10).json()
            if info["prefix_cache"]["disk"]["off"]:
                break
            time.sleep(0.2)
        disk = info["prefix_cache"]["disk"]
        assert disk["state"].startswith(f"off (disk full: cannot write {fs}/prefix-cache/"), disk
        assert "needs" in disk["state"] and "bytes free there" in disk["state"]
        assert disk["writes"] == 0 and disk["entries"] == 0
        assert [e for e in info["events"] if e["kind"] == "disk"][-1]["message"].startswith(
            "cache tier off: disk full: cannot write")
        assert info["weights_cache"]["state"] in ("on", "disabled")  # another tier: untouched
        # the node keeps serving, equal to the reference (cold: its entry is gone)
        assert complete(url, RAW["raw"], 24) == first
        assert c.procs[0].poll() is None


def test_a_request_with_no_plan_says_why_the_last_proposal_was_not_taken():
    """A member that cannot load its stage (its Hub cache's disk is full) refuses every
    proposal; a request answers 503 with that reason, not only "no plan yet". (In this
    process: the wait for a plan of a node whose negotiator recorded the refusal.)"""
    why = ("n1: cannot load its stage: disk full: cannot write /hf/models--o--m/.ringlet/partial/ab12 "
           "(downloading o/m/model.safetensors): needs 1.2 MB, 0 bytes free there; free some space or "
           "point it at a larger disk")

    class Waiting(ResumingClient):
        def __init__(self, last_result: str):
            self.config = types.SimpleNamespace(plan_wait_s=0.0)
            self.cluster = types.SimpleNamespace(last_result=last_result, agreement=None)
            self.plan = None
            self._plan_changed = asyncio.Event()

    for last, said in ((why, f"the last proposal was not taken: {why}"), ("epoch 3 committed", None)):
        with pytest.raises(NoPlanError) as err:
            asyncio.run(Waiting(last)._wait_plan())
        assert str(err.value).startswith("the cluster has no serving plan yet (still forming or re-planning)")
        assert (said in str(err.value)) if said else ";" not in str(err.value)
