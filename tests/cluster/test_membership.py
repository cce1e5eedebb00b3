"""Discovery, membership and identity with real daemons on loopback (mDNS on 127.0.0.1 only)."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from ringlet.daemon.ops.demo import LocalCluster


def member_ids(cluster: LocalCluster, i: int) -> set[str]:
    return {m["node_id"] for m in cluster.cluster_info(i)["members"]}


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} not within {timeout_s} s (last: {last})")


@pytest.fixture(scope="module")
def trio():
    with LocalCluster(3, dynamic=True) as c:
        yield c


def test_three_daemons_list_all_members(trio):
    ids = [trio.cluster_info(i)["node_id"] for i in range(3)]
    assert len(set(ids)) == 3
    for i in range(3):
        assert member_ids(trio, i) == set(ids)
        states = {m["node_id"]: m["state"] for m in trio.cluster_info(i)["members"]}
        assert states[ids[i]] == "self"
        assert all(s == "alive" for n, s in states.items() if n != ids[i])


def test_every_member_has_the_same_topology(trio):
    views = [trio.cluster_info(i) for i in range(3)]
    # each node measured its links to the two others; the union is the same graph everywhere
    edges = [sorted((link["a"], link["b"], link["kind"]) for link in v["links"]) for v in views]
    wait_until(lambda: all(len(e) == 3 for e in
                           [sorted((x["a"], x["b"]) for x in trio.cluster_info(i)["links"]) for i in range(3)]),
               15, "three measured links on every node")
    edges = [sorted((link["a"], link["b"], link["kind"]) for link in trio.cluster_info(i)["links"])
             for i in range(3)]
    assert edges[0] == edges[1] == edges[2]
    assert all(kind == "loopback" for _, _, kind in edges[0])
    for link in trio.cluster_info(0)["links"]:
        assert link["rtt_s"] > 0 and link["bandwidth_bytes_per_s"] > 0


def test_kill_is_noticed_and_restart_keeps_the_id(trio):
    victim = 2
    victim_id = trio.cluster_info(victim)["node_id"]
    trio.kill(victim)
    t0 = time.monotonic()
    wait_until(lambda: all(victim_id not in member_ids(trio, i) for i in (0, 1)), 3.0, "the killed node dropped")
    dropped_after = time.monotonic() - t0
    trio.restart(victim)
    wait_until(lambda: all(victim_id in member_ids(trio, i) for i in (0, 1)), 20, "the restarted node back")
    assert trio.cluster_info(victim)["node_id"] == victim_id
    for i in range(3):
        ids = [m["node_id"] for m in trio.cluster_info(i)["members"]]
        assert len(ids) == len(set(ids)) == 3, ids  # no ghost, no duplicate
    print(f"dropped after {dropped_after:.2f} s")


def test_other_cluster_is_never_listed(trio):
    ours = {trio.cluster_info(i)["node_id"] for i in range(3)}
    with LocalCluster(1, dynamic=True, cluster_name=trio.cluster_name + "-other") as other:
        stranger = other.cluster_info(0)["node_id"]
        time.sleep(2.0)  # several heartbeat and mDNS rounds
        for i in range(3):
            assert stranger not in member_ids(trio, i)
        assert member_ids(other, 0) == {stranger}
    assert ours == {trio.cluster_info(i)["node_id"] for i in range(3)}


def test_cloned_identity_takes_a_fresh_id(tmp_path):
    with LocalCluster(1, dynamic=True) as c:
        original = c.cluster_info(0)["node_id"]
        clone_dir = tmp_path / "clone"
        shutil.copytree(c.data_dir(0), clone_dir, ignore=shutil.ignore_patterns("node.lock"))
        assert json.loads((clone_dir / "node.json").read_text())["node_id"] == original
        i = c.add_node(extra_args=["--data-dir", str(clone_dir)])
        fresh = wait_until(lambda: (n := c.cluster_info(i)["node_id"]) != original and n, 15,
                           "the newer clone takes a fresh id")
        assert c.cluster_info(0)["node_id"] == original  # the older node keeps its id
        wait_until(lambda: member_ids(c, 0) == {original, fresh}, 15, "both listed once")


def test_peer_that_advertises_but_never_answers_is_logged_once_and_not_admitted():
    """A valid advert (this cluster, right version) whose gRPC port accepts TCP but never
    answers: the daemon tries, logs it once, never lists it, and keeps serving."""
    import asyncio
    import socket

    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    from ringlet.daemon.cluster.advert import SERVICE_TYPE, Advert, encode_txt
    from ringlet.daemon.cluster.identity import PROTOCOL_VERSION, cluster_id, new_node_id

    silent = socket.socket()  # accepts connections (backlog) and never speaks HTTP/2
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    with LocalCluster(1, dynamic=True) as c:
        me = c.cluster_info(0)["node_id"]
        ghost = Advert(new_node_id(), PROTOCOL_VERSION, port, port, cluster_id(c.cluster_name), "0badc0de",
                       int(time.time() * 1000))

        async def advertise() -> None:
            zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
            info = AsyncServiceInfo(SERVICE_TYPE, f"{ghost.node_id}-{ghost.incarnation}.{SERVICE_TYPE}",
                                    addresses=[socket.inet_aton("127.0.0.1")], port=port,
                                    properties=encode_txt(ghost, None), server="ghost.local.")
            try:
                await zc.async_register_service(info, cooperating_responders=True)
                await asyncio.sleep(8.0)  # several handshake attempts
                await zc.async_unregister_service(info)
            finally:
                await zc.async_close()

        asyncio.run(advertise())
        silent.close()
        assert member_ids(c, 0) == {me}
        log = c.log_path(0).read_text()
        assert log.count(f"127.0.0.1:{port}: no gRPC handshake") == 1, log[-2000:]
        r = httpx.post(f"{c.api_urls[0]}/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
