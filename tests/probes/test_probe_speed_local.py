"""Speed benchmark + cache, and the probe_local aggregate with its JSON round trip."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import ringlet.daemon.probes as probes
from ringlet.daemon.probes import LocalProbe, ProbeParseError, match_links, probe_local
from ringlet.daemon.probes import machine as machine_mod
from ringlet.daemon.probes import macos_thunderbolt as mtb
from ringlet.daemon.probes import memory as memory_mod
from ringlet.daemon.probes.speed import CACHE_FILE, SpeedResult, load_or_measure, measure_speed

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "macos"


def fake_result(bw: float = 1e10) -> SpeedResult:
    return SpeedResult(
        memory_bandwidth_bytes_per_s=bw,
        matmul_flops=2e9,
        device="cpu",
        matmul_dtype="float32",
        matmul_n=512,
        bandwidth_array_bytes=1 << 27,
        seconds=0.5,
        measured_at=1.0,
        mlx_version="test",
    )


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> SpeedResult:
        self.calls += 1
        return fake_result(1e10 + self.calls)


def probe_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ringlet.daemon.probes"]


# --------------------------------------------------------------------------- cache


def test_cache_absent_then_hit(tmp_path):
    m = Counter()
    first = load_or_measure(tmp_path, "k1", measure=m)
    assert m.calls == 1 and first.machine_key == "k1"
    assert json.loads((tmp_path / CACHE_FILE).read_text())["result"]["machine_key"] == "k1"
    again = load_or_measure(tmp_path, "k1", measure=m)
    assert m.calls == 1 and again == first


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[]",
        '{"format": 99, "result": {}}',
        '{"format": 1, "result": {"matmul_flops": "fast"}}',
        "\x00",
    ],
)
def test_cache_corrupt_remeasures_with_one_log_line(tmp_path, caplog, content):
    (tmp_path / CACHE_FILE).write_text(content)
    m = Counter()
    caplog.set_level(logging.INFO, logger="ringlet.daemon.probes")
    result = load_or_measure(tmp_path, "k1", measure=m)
    assert m.calls == 1 and result.memory_bandwidth_bytes_per_s > 0
    assert len(probe_records(caplog)) == 1
    assert load_or_measure(tmp_path, "k1", measure=m) == result and m.calls == 1  # rewritten


def test_cache_other_machine_remeasures(tmp_path):
    m = Counter()
    load_or_measure(tmp_path, "studio", measure=m)
    other = load_or_measure(tmp_path, "linux-box", measure=m)
    assert m.calls == 2 and other.machine_key == "linux-box"


def test_cache_unwritable_still_returns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = load_or_measure(blocker / "sub", "k", measure=Counter())  # parent is a file
    assert result is not None
    assert len(probe_records(caplog)) == 1


def test_benchmark_failure_is_none(tmp_path, caplog):
    def broken() -> SpeedResult:
        raise RuntimeError("no MLX device")

    assert load_or_measure(tmp_path, "k", measure=broken) is None
    assert len(probe_records(caplog)) == 1


def test_measure_speed_real_short():
    r = measure_speed()
    assert r.memory_bandwidth_bytes_per_s > 1e8  # > 0.1 GB/s on anything real
    assert r.matmul_flops > 1e8
    assert r.seconds < 2.0
    print(f"\nbandwidth {r.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s, matmul {r.matmul_flops / 1e9:.2f} GFLOP/s "
          f"({r.device}, {r.matmul_dtype} n={r.matmul_n}), {r.seconds:.2f} s")  # fmt: skip


# --------------------------------------------------------------------------- probe_local


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> LocalProbe:
    return probe_local(tmp_path_factory.mktemp("data"))


def test_probe_local_real_values(local):
    assert local.memory.total_bytes > 0 and local.memory.usable_memory_bytes > 0
    assert local.speed is not None and local.speed.memory_bandwidth_bytes_per_s > 0 and local.speed.matmul_flops > 0
    assert local.machine.os == sys.platform and local.machine.cpu_count >= 1
    assert any(i.is_loopback for i in local.interfaces)
    if sys.platform.startswith("linux"):
        assert local.bridge is None
        assert local.thunderbolt == ()  # no /sys/bus/thunderbolt on this box


def test_probe_local_json_round_trip(local):
    wire = json.dumps(local.to_dict())
    assert LocalProbe.from_dict(json.loads(wire)) == local


def test_probe_local_reuses_cached_speed(tmp_path):
    first = probe_local(tmp_path)
    second = probe_local(tmp_path, measure_speed=False)
    assert second.speed == first.speed
    assert probe_local(tmp_path / "empty", measure_speed=False).speed is None


def test_from_dict_rejects_bad_shapes(local):
    good = local.to_dict()
    bad_cases = [
        None,
        [],
        "x",
        {},
        {**good, "format": 2},
        {**good, "memory": None},
        {**good, "memory": {**good["memory"], "total_bytes": "lots"}},
        {**good, "memory": {**good["memory"], "total_bytes": True}},
        {**good, "thunderbolt": {"port": 1}},
        {**good, "thunderbolt": [{"port_id": 1}]},
        {**good, "interfaces": [{"name": "lo"}]},
        {**good, "speed": {**(good["speed"] or {}), "matmul_flops": float("inf")}},
    ]
    for bad in bad_cases:
        with pytest.raises(ProbeParseError):
            LocalProbe.from_dict(bad)
    # unknown keys from a newer peer are ignored
    assert LocalProbe.from_dict({**good, "future_field": 1}) == local


def _darwin_runner(sp_json: str, networksetup: str):
    outputs = {
        ("system_profiler", "SPThunderboltDataType", "-json"): (FIX / sp_json).read_text(),
        ("networksetup", "-listallhardwareports"): (FIX / networksetup).read_text(),
        ("ifconfig", "bridge0"): (FIX / "ifconfig_bridge0_macmini_3tb_members_mtu9000__mlx-issue-1903.txt").read_text(),
        ("system_profiler", "SPHardwareDataType", "-json"): (
            FIX / "sphardware_json_macstudio_m2ultra_64gb__patchd.json"
        ).read_text(),
        ("sysctl", "iogpu.wired_limit_mb"): "iogpu.wired_limit_mb: 0\n",  # documented format, not a capture
    }
    calls: list[tuple[str, ...]] = []

    def run(argv, parser, **kw):
        calls.append(tuple(argv))
        text = outputs.get(tuple(argv))
        return None if text is None else parser(text)  # e.g. `sysctl hw`: "missing" -> None

    return run, calls


def test_probe_local_darwin_parsers_and_link_over_json(tmp_path, monkeypatch):
    """macOS path with the captured outputs fed to the runners; two nodes' probes travel as JSON
    and still give the one Studio <-> MBP link (studio-a port 2/en3 <-> mbp-a port 1/en1, 80 Gb/s)."""
    monkeypatch.setattr(memory_mod, "mlx_device_info", lambda: None)
    monkeypatch.setattr(probes, "load_or_measure", lambda data_dir, key: fake_result())
    wires = {}
    for node, sp, ns in [
        (
            "studio-a",
            "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json",
            "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt",
        ),
        (
            "mbp-a",
            "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json",
            "networksetup_listallhardwareports_macbookpro_3tb_with_bridge0__d-inference_macB.txt",
        ),
    ]:
        run, calls = _darwin_runner(sp, ns)
        for mod in (machine_mod, memory_mod, mtb):
            monkeypatch.setattr(mod, "run_probe", run)
        p = probe_local(tmp_path, platform="darwin")
        assert ("system_profiler", "SPThunderboltDataType", "-json") in calls
        assert p.machine.chip == "Apple M2 Ultra"  # the hardware capture is another Mac; fine here
        wires[node] = json.dumps(p.to_dict())
        if node == "studio-a":
            assert p.bridge is None and ("ifconfig", "bridge0") not in calls  # no Thunderbolt Bridge port
        else:
            assert p.bridge is not None and p.bridge.members == ("en2", "en3", "en4")
    nodes = {n: LocalProbe.from_dict(json.loads(w)).thunderbolt for n, w in wires.items()}
    (link,) = match_links(nodes)
    assert (link.node_a, link.port_a, link.iface_a) == ("mbp-a", "1", "en1")
    assert (link.node_b, link.port_b, link.iface_b) == ("studio-a", "2", "en3")
    assert link.speed_bytes_per_s == 10_000_000_000 and not link.rdma_both


def test_probe_local_darwin_commands_missing(tmp_path, monkeypatch, caplog):
    """Every macOS command missing: probe_local still returns, with empty Thunderbolt data."""
    monkeypatch.setattr(memory_mod, "mlx_device_info", lambda: None)
    monkeypatch.setattr(probes, "load_or_measure", lambda data_dir, key: replace(fake_result(), machine_key=key))
    p = probe_local(tmp_path, platform="darwin")  # real runners: no system_profiler etc. on Linux
    assert p.thunderbolt == () and p.bridge is None and p.machine.chip is None
    assert p.memory.total_bytes > 0
    assert len(probe_records(caplog)) >= 3  # one line per failed command
