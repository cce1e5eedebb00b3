"""Bad input: missing commands, failing commands, garbage, truncation, and fuzzing of every parser.

Contract: a parser raises only ProbeParseError; a runner returns None and logs exactly one line.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringlet.daemon.probes import LocalProbe
from ringlet.daemon.probes.common import ProbeParseError, read_probe_file, run_probe
from ringlet.daemon.probes.linux_thunderbolt import (
    parse_dmesg_thunderbolt,
    parse_ifconfig_linux,
    parse_lane_speed,
    parse_uevent,
)
from ringlet.daemon.probes.machine import (
    parse_proc_cpuinfo,
    parse_sphardware_json,
    parse_sphardware_text,
    parse_sysctl,
    parse_sysctl_hw_values,
)
from ringlet.daemon.probes.macos_ifconfig import parse_ifconfig_macos
from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports, parse_network_services
from ringlet.daemon.probes.macos_spthunderbolt import parse_spthunderbolt_json, parse_spthunderbolt_text
from ringlet.daemon.probes.memory import parse_device_info, parse_sysctl_wired_limit

FIX = Path(__file__).resolve().parents[1] / "fixtures"
M, L = FIX / "macos", FIX / "linux"

# parser -> real inputs it must accept
PARSERS = {
    parse_spthunderbolt_json: [
        M / "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json",
        M / "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json",
        M / "spthunderbolt_json_TRIMMED_macstudio_m3ultra_two_cables_to_macbookpro_m4max.json",
        M / "spthunderbolt_json_TRIMMED_macbookpro_m4max_two_cables_to_macstudio_m3ultra.json",
    ],
    parse_spthunderbolt_text: [M / "spthunderbolt_text_PARTIAL_macmini_cabled_to_macstudio_m4max__exo-issue-1390.txt"],
    parse_hardware_ports: sorted(M.glob("networksetup_listallhardwareports_*.txt")),
    parse_network_services: [M / "networksetup_listallnetworkservices_macmini_m1_thunderbolt_peer__chrisbergeron.txt"],
    parse_ifconfig_macos: sorted(M.glob("ifconfig_bridge0_*.txt")),
    parse_sphardware_json: [M / "sphardware_json_macstudio_m2ultra_64gb__patchd.json"],
    parse_sphardware_text: [M / "sphardware_text_GREPPED_with_stderr_noise_macstudio_m4max__xcodebenchmark-664.txt"],
    parse_sysctl_hw_values: [
        M / "sysctl_-n_hw.memsize_hw.ncpu_machdep.cpu.brand_string_macstudio_m2ultra_64gb__patchd.txt"
    ],
    parse_sysctl: [M / "UNATTRIBUTED_sysctl_cpu_perflevel_macstudio_m3ultra_96gb.txt"],
    parse_device_info: sorted(M.glob("mx_metal_device_info_*.txt")),
    parse_proc_cpuinfo: [Path("/proc/cpuinfo")],
    parse_dmesg_thunderbolt: [L / "linux_dmesg_thunderbolt_new_host_found_macmini9_1__chrisbergeron.txt"],
    parse_ifconfig_linux: [L / "linux_ifconfig_thunderbolt0_to_macmini_m1__chrisbergeron.txt"],
}
SAMPLES = {p: [f.read_text(encoding="utf-8") for f in files] for p, files in PARSERS.items()}
SAMPLES[parse_sysctl_wired_limit] = ["iogpu.wired_limit_mb: 0\n", "0\n"]  # documented formats, not captures
SAMPLES[parse_lane_speed] = (
    (L / "linux_sys_bus_thunderbolt_tx_rx_speed_macmini_peer__chrisbergeron.txt")
    .read_text(encoding="utf-8")
    .splitlines()[1:]
)
SAMPLES[parse_uevent] = ["DEVTYPE=thunderbolt_xdomain\n"]
ALL_PARSERS = list(SAMPLES)
IDS = [p.__name__ for p in ALL_PARSERS]


def probe_logs(caplog) -> list[str]:
    msgs = [r.getMessage() for r in caplog.records if r.name == "ringlet.daemon.probes"]
    assert all("\n" not in m for m in msgs), msgs  # one line each
    return msgs


def test_every_parser_has_its_fixtures():
    for parser, texts in SAMPLES.items():
        assert texts, parser.__name__
        for t in texts:
            parser(t)  # real captures parse


# --------------------------------------------------------------------------- runner


def test_missing_binary(caplog):
    assert run_probe(["/nonexistent/ringlet-no-such-tool", "-json"], parse_spthunderbolt_json) is None
    (msg,) = probe_logs(caplog)
    assert "command not found" in msg


def test_nonzero_exit(caplog):
    assert run_probe(["sh", "-c", "echo 'unknown oid' >&2; exit 3"], parse_sysctl_wired_limit, name="sysctl") is None
    (msg,) = probe_logs(caplog)
    assert "exit status 3" in msg and "unknown oid" in msg


def test_timeout(caplog):
    assert run_probe(["sleep", "5"], parse_sysctl, timeout=0.2) is None
    (msg,) = probe_logs(caplog)
    assert "timed out" in msg


def test_not_executable(tmp_path, caplog):
    f = tmp_path / "tool"
    f.write_text("#!/bin/sh\necho hi\n")
    os.chmod(f, 0o644)
    assert run_probe([str(f)], parse_sysctl) is None
    assert len(probe_logs(caplog)) == 1


def test_success_logs_nothing(caplog):
    src = M / "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json"
    sp = run_probe(["cat", str(src)], parse_spthunderbolt_json)
    assert sp is not None and len(sp.ports) == 3
    assert probe_logs(caplog) == []


def test_parser_bug_is_contained(caplog):
    def buggy(text: str) -> None:
        raise KeyError("bug")

    assert run_probe(["echo", "x"], buggy) is None
    assert len(probe_logs(caplog)) == 1


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=IDS)
def test_empty_output(parser, caplog):
    assert run_probe(["true"], parser) is None
    assert len(probe_logs(caplog)) == 1


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=IDS)
def test_random_bytes(parser, tmp_path, caplog):
    rnd = random.Random(parser.__name__)
    junk = tmp_path / "junk"
    junk.write_bytes(bytes(rnd.randrange(256) for _ in range(4096)))
    assert run_probe(["cat", str(junk)], parser) is None
    assert len(probe_logs(caplog)) == 1


@pytest.mark.parametrize("parser", [parse_spthunderbolt_json, parse_sphardware_json], ids=lambda p: p.__name__)
def test_truncated_json(parser, caplog):
    src = PARSERS[parser][0]
    assert run_probe(["head", "-c", "300", str(src)], parser) is None
    (msg,) = probe_logs(caplog)
    assert "unparsable" in msg


def test_read_probe_file_failures(tmp_path, caplog):
    assert read_probe_file(tmp_path / "missing", parse_proc_cpuinfo) is None
    assert read_probe_file(tmp_path, parse_proc_cpuinfo) is None  # a directory
    (tmp_path / "junk").write_bytes(b"\xff\xfe\x00garbage")
    assert read_probe_file(tmp_path / "junk", parse_proc_cpuinfo) is None
    assert len(probe_logs(caplog)) == 3
    assert read_probe_file("/proc/cpuinfo", parse_proc_cpuinfo) is not None


# --------------------------------------------------------------------------- fuzz (hypothesis)

# RINGLET_FUZZ_EXAMPLES=5000 for a long run; 60 keeps the suite fast
FUZZ = settings(
    max_examples=int(os.environ.get("RINGLET_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


def _only_documented_error(parser, text: str) -> None:
    try:
        parser(text)
    except ProbeParseError:
        pass


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=IDS)
@FUZZ
@given(text=st.text(max_size=400))
def test_fuzz_random_text(parser, text):
    _only_documented_error(parser, text)


@pytest.mark.parametrize("parser", ALL_PARSERS, ids=IDS)
@FUZZ
@given(data=st.data())
def test_fuzz_mutated_captures(parser, data):
    """Cut, splice and corrupt the real captures: near-valid input is the dangerous kind."""
    src = data.draw(st.sampled_from(SAMPLES[parser]))
    i = data.draw(st.integers(0, len(src)))
    j = data.draw(st.integers(i, len(src)))
    ins = data.draw(st.text(max_size=30) | st.sampled_from(["\n", ": ", "{", "}", "0x", "Gb/s", "-1", "\t", '"']))
    _only_documented_error(parser, src[:i] + ins + src[j:])


SP_KEYS = [
    "_items", "_name", "domain_uuid_key", "receptacle_1_tag", "receptacle_id_key", "current_speed_key",
    "services_title", "protocol_id_key", "device_name_key", "link_status_key", "chip_type", "physical_memory",
    "number_processors", "machine_name", "machine_model", "cpu_type",
]  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.sampled_from(["80 Gb/s", "Up to 120 Gb/s", "64 GB", "proc 24:16:8:0", "55555555-0000-4000-8000-000000005001"]),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.sampled_from(SP_KEYS) | st.text(max_size=5), kids, max_size=5),
    max_leaves=25,
)  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "top"),
    [(parse_spthunderbolt_json, "SPThunderboltDataType"), (parse_sphardware_json, "SPHardwareDataType")],
    ids=["spthunderbolt", "sphardware"],
)
@FUZZ
@given(value=JSON)
def test_fuzz_json_structure(parser, top, value):
    _only_documented_error(parser, json.dumps({top: value}))
    _only_documented_error(parser, json.dumps(value))


def test_deeply_nested_json():
    deep = '{"SPThunderboltDataType": [{"_items": ' * 5000 + "[]" + "}]" * 5000 + "}"
    _only_documented_error(parse_spthunderbolt_json, deep)
    nested_items = {"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": {"receptacle_id_key": "1"}}]}
    node = nested_items["SPThunderboltDataType"][0]
    for k in range(200):  # a long chain of docks (json itself limits nesting near 1000)
        child = {"_name": f"dock{k}"}
        node["_items"] = [child]
        node = child
    node["domain_uuid_key"] = "55555555-0000-4000-8000-000000005001"
    (port,) = parse_spthunderbolt_json(json.dumps(nested_items)).ports
    assert port.peer_domain_uuid == "55555555-0000-4000-8000-000000005001" and len(port.via) == 199


@FUZZ
@given(value=JSON)
def test_fuzz_local_probe_from_dict(value):
    try:
        LocalProbe.from_dict(value)
    except ProbeParseError:
        pass


def test_probe_logger_is_quiet_on_success(caplog):
    caplog.set_level(logging.DEBUG, logger="ringlet.daemon.probes")
    for parser, texts in SAMPLES.items():
        for t in texts:
            parser(t)
    assert probe_logs(caplog) == []
