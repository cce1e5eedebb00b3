"""Machine and memory parsers on the captured outputs, plus the real probes on this Linux machine.

Expected values written by hand from tests/fixtures/macos (SOURCES.md §3).
"""

from __future__ import annotations

import os
import sys
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from ringlet.daemon.probes import machine as machine_mod
from ringlet.daemon.probes import memory as memory_mod
from ringlet.daemon.probes.common import ProbeParseError
from ringlet.daemon.probes.machine import (
    MacHardware,
    PerfLevel,
    parse_proc_cpuinfo,
    parse_sphardware_json,
    parse_sphardware_text,
    parse_sysctl,
    parse_sysctl_hw_values,
    probe_machine,
)
from ringlet.daemon.probes.memory import (
    DeviceInfo,
    WiredLimit,
    parse_device_info,
    parse_sysctl_wired_limit,
    probe_memory,
    usable_memory_bytes,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "macos"
GIB = 1 << 30


def fx(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- machine


def test_sphardware_json_m2_ultra():
    hw = parse_sphardware_json(fx("sphardware_json_macstudio_m2ultra_64gb__patchd.json"))
    assert hw == MacHardware(
        model_name="Mac Studio",
        model_identifier="Mac14,14",
        chip="Apple M2 Ultra",
        memory_bytes=64 * GIB,  # "64 GB"
        cpu_count=24,  # "proc 24:16:8:0"
        performance_cores=16,
        efficiency_cores=8,
        model_number="Z180000AEBZ/A",
        number_processors="proc 24:16:8:0",
    )


def test_sysctl_n_triple_same_mac():
    sc = parse_sysctl_hw_values(
        fx("sysctl_-n_hw.memsize_hw.ncpu_machdep.cpu.brand_string_macstudio_m2ultra_64gb__patchd.txt")
    )
    assert (sc.memsize_bytes, sc.ncpu, sc.brand_string) == (68719476736, 24, "Apple M2 Ultra")
    # the same Mac's system_profiler "64 GB" is binary: 64 * 2**30 == hw.memsize
    assert (
        sc.memsize_bytes
        == parse_sphardware_json(fx("sphardware_json_macstudio_m2ultra_64gb__patchd.json")).memory_bytes
    )
    for bad in ("", "68719476736\n24\n", "x\n24\nApple\n", "-1\n24\nApple\n"):
        with pytest.raises(ProbeParseError):
            parse_sysctl_hw_values(bad)


def test_sphardware_text_grepped_with_stderr_noise():
    hw = parse_sphardware_text(fx("sphardware_text_GREPPED_with_stderr_noise_macstudio_m4max__xcodebenchmark-664.txt"))
    assert hw.model_name == "Mac Studio" and hw.model_identifier == "Mac16,9"
    assert hw.chip is None  # the grep did not keep a "Chip:" line
    assert (hw.cpu_count, hw.performance_cores, hw.efficiency_cores) == (16, 12, 4)
    assert hw.memory_bytes == 128 * GIB
    with pytest.raises(ProbeParseError):  # only noise lines
        parse_sphardware_text("2026-04-28 08:52:35.280 system_profiler[29046:41174793] hw.cpufamily: 0x17d5b93a\n")


def test_sysctl_perflevels_m3_ultra():
    sc = parse_sysctl(fx("UNATTRIBUTED_sysctl_cpu_perflevel_macstudio_m3ultra_96gb.txt"))
    assert sc.brand_string == "Apple M3 Ultra"
    assert (sc.memsize_bytes, sc.ncpu, sc.physicalcpu) == (103079215104, 28, 28)
    assert sc.perflevels == (
        PerfLevel(0, physicalcpu=20, l1icachesize=196608, l1dcachesize=131072, l2cachesize=16777216, cpusperl2=5),
        PerfLevel(1, physicalcpu=8, l1icachesize=131072, l1dcachesize=65536, l2cachesize=4194304, cpusperl2=4),
    )
    with pytest.raises(ProbeParseError):
        parse_sysctl("hw.perflevel0.physicalcpu: lots\n")


def test_proc_cpuinfo_real_file_on_this_machine():
    cpu = parse_proc_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert cpu.logical_cpus == os.cpu_count() == psutil.cpu_count(logical=True)
    assert cpu.model_name  # "AMD EPYC" here
    if cpu.physical_cores is not None:
        assert 1 <= cpu.physical_cores <= cpu.logical_cpus
    with pytest.raises(ProbeParseError):
        parse_proc_cpuinfo("model name : nothing else\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux probe")
def test_probe_machine_linux_real():
    m = probe_machine()
    assert m.os == sys.platform and m.arch
    assert m.chip == parse_proc_cpuinfo(Path("/proc/cpuinfo").read_text()).model_name
    assert m.cpu_count == os.cpu_count()
    assert m.memory_bytes == psutil.virtual_memory().total


def _fake_runner(outputs: dict[tuple[str, ...], str]):
    calls = []

    def run(argv, parser, **kw):
        calls.append(tuple(argv))
        text = outputs.get(tuple(argv))
        return None if text is None else parser(text)

    return run, calls


def test_probe_machine_darwin_uses_macos_parsers(monkeypatch):
    run, calls = _fake_runner(
        {
            ("system_profiler", "SPHardwareDataType", "-json"): fx(
                "sphardware_json_macstudio_m2ultra_64gb__patchd.json"
            ),
            ("sysctl", "hw", "machdep.cpu.brand_string"): fx(
                "sysctl_-n_hw.memsize_hw.ncpu_machdep.cpu.brand_string_macstudio_m2ultra_64gb__patchd.txt"
            ).replace("68719476736\n24\n", "hw.memsize: 68719476736\nhw.ncpu: 24\nmachdep.cpu.brand_string: "),
        }
    )
    monkeypatch.setattr(machine_mod, "run_probe", run)
    m = probe_machine("darwin")
    assert calls == [("system_profiler", "SPHardwareDataType", "-json"), ("sysctl", "hw", "machdep.cpu.brand_string")]
    assert (m.os, m.chip, m.model_name, m.model_identifier) == ("darwin", "Apple M2 Ultra", "Mac Studio", "Mac14,14")
    assert (m.cpu_count, m.performance_cores, m.efficiency_cores, m.memory_bytes) == (24, 16, 8, 64 * GIB)


# --------------------------------------------------------------------------- memory


def test_device_info_m3_ultra_6_keys():
    d = parse_device_info(fx("mx_metal_device_info_macstudio_m3ultra_256gb__ember-ml.py.txt"))
    assert d == DeviceInfo(
        device_name="Apple M3 Ultra",
        architecture="applegpu_g15d",
        max_recommended_working_set_size=223338299392,
        memory_size=274877906944,  # 256 GiB
        max_buffer_length=167503724544,
        resource_limit=499000,
    )


def test_device_info_old_3_key_format():
    d = parse_device_info(fx("mx_metal_device_info_applegpu_g14d_early_3key_format__mlx-pr-1060.txt"))
    assert d == DeviceInfo(
        architecture="applegpu_g14d", max_recommended_working_set_size=188743680000, max_buffer_length=115964116992
    )
    assert d.memory_size is None and d.device_name is None


def test_device_info_garbage():
    for bad in ("", "{}", "{'memory_size': 'big'}", "{'memory_size': -1}", "{__import__('os')}", "{1: 2", "[1]"):
        with pytest.raises(ProbeParseError):
            parse_device_info(bad)


def test_wired_limit_formats():
    assert parse_sysctl_wired_limit("iogpu.wired_limit_mb: 0\n") == WiredLimit(0)
    assert WiredLimit(0).bytes is None
    assert parse_sysctl_wired_limit("180000\n").bytes == 180000 * (1 << 20)  # MiB
    for bad in ("", "sysctl: unknown oid 'iogpu.wired_limit_mb'", "iogpu.wired_limit_mb: -5"):
        with pytest.raises(ProbeParseError):
            parse_sysctl_wired_limit(bad)


def test_usable_memory_rule():
    total = 274877906944  # the M3 Ultra 256 GB of the ember-ml capture
    max_rec = 223338299392
    assert usable_memory_bytes(total, None, max_rec) == (max_rec, "max_recommended_working_set_size")
    assert usable_memory_bytes(total, 240 * GIB, max_rec) == (240 * GIB, "iogpu.wired_limit_mb")
    assert usable_memory_bytes(total, 300 * GIB, max_rec) == (total, "iogpu.wired_limit_mb")  # capped
    assert usable_memory_bytes(100, None, None) == (80, "80% of total")


def test_probe_memory_darwin_path(monkeypatch):
    vm = namedtuple("vm", "total available")(274877906944, 200 * GIB)
    monkeypatch.setattr(memory_mod.psutil, "virtual_memory", lambda: vm)
    run, calls = _fake_runner({("sysctl", "iogpu.wired_limit_mb"): "iogpu.wired_limit_mb: 0\n"})
    monkeypatch.setattr(memory_mod, "run_probe", run)
    info = parse_device_info(fx("mx_metal_device_info_macstudio_m3ultra_256gb__ember-ml.py.txt"))
    monkeypatch.setattr(memory_mod, "mlx_device_info", lambda: info)
    m = probe_memory("darwin")
    assert calls == [("sysctl", "iogpu.wired_limit_mb")]
    assert m.usable_memory_bytes == 223338299392 and m.usable_rule == "max_recommended_working_set_size"
    assert (m.device_memory_bytes, m.device_name) == (274877906944, "Apple M3 Ultra")
    assert m.wired_limit_bytes is None


def test_probe_memory_real_linux():
    m = probe_memory()
    assert m.total_bytes > 0 and 0 < m.available_bytes <= m.total_bytes
    assert 0 < m.usable_memory_bytes <= m.total_bytes
    if sys.platform.startswith("linux"):
        # the host's rule, or this process's cgroup where its limit binds lower (a container, a service)
        assert m.usable_rule == "80% of total" or m.usable_rule.startswith("cgroup v"), m
        assert m.wired_limit_bytes is None
        assert m.architecture  # the CPU MLX build reports architecture and device_name only
