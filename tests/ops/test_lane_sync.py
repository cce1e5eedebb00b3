"""The set of models a node keeps across restarts and the order two sets are compared in
(daemon/ops/lane_sync.py); no daemons: the lanes are never started."""

from __future__ import annotations

from ringlet.daemon.ops.lane_sync import ModelSync, _order
from ringlet.daemon.ops.lanes import Lanes


def node(tmp_path, models):
    lanes = Lanes(["run"], models, {}, grpc_port=7100, data_dir=tmp_path, cluster="c", usable_bytes=10**9,
                  public_api_url="http://h:8000", supervisor_url="http://127.0.0.1:8000")
    sync = ModelSync(lanes, tmp_path / "models.json", "http://h:8000", {})
    sync.restore()
    return lanes, sync


def keys(lanes) -> list[str]:
    return [lane.key for lane in lanes.lanes]


def test_a_restart_serves_what_was_loaded_and_unloaded_at_run_time(tmp_path):
    lanes, sync = node(tmp_path, ["a", "b"])
    lanes.add("x", ["fast"])  # `models load x --alias fast`
    lanes.lanes.remove(lanes.find("b"))  # `models unload b`
    lanes.version = 2
    sync.save()
    lanes, _ = node(tmp_path, ["a", "b"])
    assert keys(lanes) == ["a", "x"] and lanes.version == 2
    assert lanes.find("fast").key == "x" and lanes.lanes[0].primary


def test_a_changed_command_line_wins_and_the_first_model_stays(tmp_path):
    lanes, sync = node(tmp_path, ["a", "b"])
    lanes.add("x", [])
    lanes.version = 3
    sync.save()
    lanes, _ = node(tmp_path, ["c", "a"])
    assert keys(lanes) == ["c", "a"] and lanes.version == 3 and lanes.lanes[0].primary


def test_the_newer_set_is_the_higher_version_then_the_larger_list():
    older = {"version": 2, "models": [{"key": "a"}, {"key": "z"}]}
    newer = {"version": 3, "models": [{"key": "a"}]}
    assert _order(newer) > _order(older)
    one, other = {"version": 3, "models": [{"key": "a"}, {"key": "b"}]}, {"version": 3, "models": [{"key": "a"}]}
    assert _order(one) != _order(other) and max(_order(one), _order(other)) == _order(one)
