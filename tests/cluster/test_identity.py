"""Node identity: persistence across restarts, the data-dir lock, clones, cluster ids."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from ringlet.daemon.cluster.identity import (
    NODE_FILE,
    PROTOCOL_VERSION,
    DataDirLocked,
    NodeIdentity,
    cluster_id,
    should_yield,
    validate_node_id,
)


def test_first_start_creates_0600_file_and_restart_keeps_id(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = NodeIdentity.load_or_create(data, now=1000.0)
    assert len(first.node_id) == 16 and int(first.node_id, 16) >= 0
    path = data / NODE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    doc = json.loads(path.read_text())
    assert doc == {"node_id": first.node_id, "created_at": 1000.0, "history": []}
    first.close()

    second = NodeIdentity.load_or_create(data, now=2000.0)
    assert second.node_id == first.node_id
    assert second.created_at == 1000.0
    assert second.started_at == 2000.0
    assert second.incarnation != first.incarnation  # fresh per process
    assert second.started_at_ms == 2_000_000
    second.close()
    # no temp files left behind by the atomic write
    assert sorted(p.name for p in data.iterdir()) == ["node.json", "node.lock"]


def test_two_processes_cannot_share_a_data_dir(tmp_path: Path) -> None:
    with NodeIdentity.load_or_create(tmp_path):
        with pytest.raises(DataDirLocked, match="--data-dir"):
            NodeIdentity.load_or_create(tmp_path)
        # a reader (ringlet status) may look without locking
        reader = NodeIdentity.load_or_create(tmp_path, lock=False)
        reader.close()
    NodeIdentity.load_or_create(tmp_path).close()  # released on close


def test_separate_data_dirs_get_separate_ids(tmp_path: Path) -> None:
    with NodeIdentity.load_or_create(tmp_path / "a") as a, NodeIdentity.load_or_create(tmp_path / "b") as b:
        assert a.node_id != b.node_id


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", b'{"node_id": "UPPER", "created_at": 1}', b'{"node_id": "abc"}', b"\xff\xfe"],
)
def test_corrupt_file_is_moved_aside_and_replaced(tmp_path: Path, content: bytes, caplog) -> None:
    (tmp_path / NODE_FILE).write_bytes(content)
    with caplog.at_level(logging.WARNING), NodeIdentity.load_or_create(tmp_path, now=5.0) as ident:
        validate_node_id(ident.node_id)
    assert (tmp_path / f"{NODE_FILE}.corrupt-5").read_bytes() == content
    assert json.loads((tmp_path / NODE_FILE).read_text())["node_id"] == ident.node_id
    assert "unusable" in caplog.text


def test_regenerate_persists_new_id_and_history(tmp_path: Path, caplog) -> None:
    with NodeIdentity.load_or_create(tmp_path, now=100.0) as ident:
        old = ident.node_id
        with caplog.at_level(logging.WARNING):
            new = ident.regenerate("clone of node at 10.0.0.2 started earlier", now=200.0)
        assert new == ident.node_id != old
        assert f"node id {old} replaced by {new}: clone of node at 10.0.0.2" in caplog.text
    with NodeIdentity.load_or_create(tmp_path) as again:
        assert again.node_id == new
        assert again.created_at == 200.0
        assert again.history == [
            {
                "node_id": old,
                "created_at": 100.0,
                "replaced_at": 200.0,
                "reason": "clone of node at 10.0.0.2 started earlier",
            }
        ]


def test_clone_rule_newer_start_yields_exactly_one() -> None:
    # the later start yields, whichever side evaluates it
    assert should_yield(2000, "aaaaaaaa", 1000, "bbbbbbbb") is True
    assert should_yield(1000, "bbbbbbbb", 2000, "aaaaaaaa") is False
    # equal start times: larger incarnation yields
    assert should_yield(1000, "bbbbbbbb", 1000, "aaaaaaaa") is True
    assert should_yield(1000, "aaaaaaaa", 1000, "bbbbbbbb") is False
    with pytest.raises(ValueError, match="node itself"):
        should_yield(1000, "aaaaaaaa", 1000, "aaaaaaaa")


def test_cloned_data_dir_both_load_same_id_and_the_later_yields(tmp_path: Path) -> None:
    orig = NodeIdentity.load_or_create(tmp_path / "orig", now=1000.0)
    clone_dir = tmp_path / "clone"
    clone_dir.mkdir()
    (clone_dir / NODE_FILE).write_bytes((tmp_path / "orig" / NODE_FILE).read_bytes())  # disk copy
    clone = NodeIdentity.load_or_create(clone_dir, now=1500.0)
    assert clone.node_id == orig.node_id and clone.created_at == orig.created_at
    assert clone.should_yield_to(orig.started_at_ms, orig.incarnation)
    assert not orig.should_yield_to(clone.started_at_ms, clone.incarnation)
    orig.close()
    clone.close()


def test_cluster_id_and_protocol_version() -> None:
    assert PROTOCOL_VERSION == 1
    cid = cluster_id("home")
    assert len(cid) == 16 and cid == cluster_id("home") != cluster_id("Home")
    assert all(c in "0123456789abcdef" for c in cid)
    with pytest.raises(ValueError):
        cluster_id("")


@pytest.mark.parametrize("bad", ["", "-x", "A1", "a" * 33, "a.b", "a b", None, 5])
def test_validate_node_id_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        validate_node_id(bad)


