"""The cgroup limit readers on captured and constructed /proc and /sys trees
(tests/fixtures/linux/cgroup, SOURCES.md §6), and the usable-memory rule they feed.

Expected values are computed by hand from the fixture files (the figures in the comments).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from ringlet.daemon.probes import memory as memory_mod
from ringlet.daemon.probes.cgroup_memory import (
    CgroupLocation,
    CgroupMemory,
    locate,
    parse_limit,
    parse_memory_stat,
    parse_mountinfo,
    parse_proc_cgroup,
    read_cgroup_memory,
    used_without_cache,
)
from ringlet.daemon.probes.common import ProbeParseError
from ringlet.daemon.probes.memory import MemoryInfo, usable_with_cgroup, with_cgroup

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "linux" / "cgroup"
JOB = "/jobs/00000000000000000000000000000001"
CID = "4f1d2c3b5a6978e0d1c2b3a4958677f6e5d4c3b2a1908f7e6d5c4b3a29180716"


def text(case: str, rel: str) -> str:
    return (FIX / case / rel).read_text()


def copy(case: str, tmp_path: Path) -> Path:
    root = tmp_path / case
    shutil.copytree(FIX / case, root)
    return root


# --------------------------------------------------------------------------- parsers


def test_proc_cgroup_v1_hybrid_capture():
    lines = parse_proc_cgroup(text("v1_host_hybrid", "proc/self/cgroup"))
    assert len(lines) == 10
    assert lines[5].hierarchy == 4 and lines[5].controllers == ("memory",)
    assert lines[5].path == f"{JOB}/ringlet-a"
    assert lines[0].controllers == ("name=systemd",)
    assert (lines[-1].hierarchy, lines[-1].controllers, lines[-1].path) == (0, (), "/")


def test_proc_cgroup_keeps_colons_in_the_path_and_refuses_garbage():
    assert parse_proc_cgroup("0::/a:b\n")[0].path == "/a:b"
    with pytest.raises(ProbeParseError):
        parse_proc_cgroup("memory:/x\n")
    with pytest.raises(ProbeParseError):
        parse_proc_cgroup("x:memory:/x\n")
    with pytest.raises(ProbeParseError):
        parse_proc_cgroup("   \n")


def test_mountinfo_finds_only_cgroup_mounts():
    hybrid = parse_mountinfo(text("v1_host_hybrid", "proc/self/mountinfo"))
    assert [m.mount_point for m in hybrid if m.fstype == "cgroup2"] == ["/sys/fs/cgroup/unified"]
    memory = [m for m in hybrid if "memory" in m.super_options]
    assert len(memory) == 1 and (memory[0].root, memory[0].mount_point) == ("/", "/sys/fs/cgroup/memory")
    docker = parse_mountinfo(text("v1_docker", "proc/self/mountinfo"))
    assert len(docker) == 7  # name=systemd and six controllers; overlay, proc, tmpfs... skipped
    memory = [m for m in docker if "memory" in m.super_options][0]
    assert (memory.root, memory.mount_point) == (f"/docker/{CID}", "/sys/fs/cgroup/memory")
    assert "cpu" not in memory.super_options
    v2 = parse_mountinfo(text("v2_docker", "proc/self/mountinfo"))
    assert [(m.fstype, m.root, m.mount_point) for m in v2] == [("cgroup2", "/", "/sys/fs/cgroup")]


def test_mountinfo_unescapes_octal_mount_points():
    line = r"40 31 0:37 / /mnt/my\040cgroups rw,relatime shared:3 - cgroup2 cgroup2 rw" + "\n"
    assert parse_mountinfo(line)[0].mount_point == "/mnt/my cgroups"


def test_limit_values():
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None  # v1 unlimited: PAGE_COUNTER_MAX * 4096
    assert parse_limit("3399999488\n") == 3_399_999_488
    for bad in ("", "lots", "-1"):
        with pytest.raises(ProbeParseError):
            parse_limit(bad)


def test_memory_stat_and_use_without_page_cache():
    stat = parse_memory_stat(text("v1_host_hybrid", f"sys/fs/cgroup/memory{JOB}/ringlet-a/memory.stat"))
    assert stat["total_cache"] == 100_003_840 and stat["total_inactive_file"] == 0
    # the capture's 100 MB of page cache is all *active* file pages: inactive_file alone would count it as used
    assert used_without_cache(1, 308_256_768, stat) == (308_256_768 - 100_003_840, 100_003_840)
    v2 = parse_memory_stat(text("v2_docker", "sys/fs/cgroup/memory.stat"))
    # file 157286400 less shmem 8388608 (tmpfs cannot be dropped)
    assert used_without_cache(2, 570_425_344, v2) == (570_425_344 - 148_897_792, 148_897_792)
    assert used_without_cache(2, 1000, {"inactive_file": 300}) == (700, 300)  # no file key: the working set
    assert used_without_cache(2, 1000, {}) == (1000, None)


# --------------------------------------------------------------------------- locating


def test_locate_v1_hybrid_walks_to_the_mount():
    loc = locate(text("v1_host_hybrid", "proc/self/cgroup"), text("v1_host_hybrid", "proc/self/mountinfo"))
    m = "/sys/fs/cgroup/memory"
    assert loc == CgroupLocation(1, f"{JOB}/ringlet-a", (f"{m}{JOB}/ringlet-a", f"{m}{JOB}", f"{m}/jobs", m))


def test_locate_v1_docker_maps_the_mount_root():
    loc = locate(text("v1_docker", "proc/self/cgroup"), text("v1_docker", "proc/self/mountinfo"))
    assert loc == CgroupLocation(1, f"/docker/{CID}", ("/sys/fs/cgroup/memory",))


def test_locate_v2_container_namespace_and_service():
    assert locate("0::/\n", text("v2_docker", "proc/self/mountinfo")) == CgroupLocation(2, "/", ("/sys/fs/cgroup",))
    loc = locate(text("v2_systemd_service", "proc/self/cgroup"), text("v2_systemd_service", "proc/self/mountinfo"))
    assert loc.directories == ("/sys/fs/cgroup/system.slice/ringlet.service", "/sys/fs/cgroup/system.slice",
                               "/sys/fs/cgroup")


def test_locate_without_a_memory_cgroup():
    assert locate("0::/\n", "22 27 0:21 / /proc rw,relatime - proc proc rw\n") is None
    # a path outside the mount's root (another namespace's view): the mount point itself
    mount = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    assert locate("4:memory:/other\n", mount).directories == ("/sys/fs/cgroup/memory",)


# --------------------------------------------------------------------------- reading the trees


def test_read_v1_host_capture():
    m = "/sys/fs/cgroup/memory"
    assert read_cgroup_memory(FIX / "v1_host_hybrid") == CgroupMemory(
        version=1, path=f"{JOB}/ringlet-a", directory=f"{m}{JOB}/ringlet-a", limit_bytes=3_399_999_488,
        limit_file="memory.limit_in_bytes", limit_directory=f"{m}{JOB}/ringlet-a",
        used_bytes=208_252_928, page_cache_bytes=100_003_840)  # 308256768 - 100003840


def test_read_v1_docker():
    got = read_cgroup_memory(FIX / "v1_docker")
    assert (got.limit_bytes, got.limit_file, got.directory) == (536_870_912, "memory.limit_in_bytes",
                                                                "/sys/fs/cgroup/memory")
    # usage 408944640 less total_cache 134217728 plus total_shmem 4194304
    assert (got.used_bytes, got.page_cache_bytes) == (278_921_216, 130_023_424)
    assert got.describe() == "cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory)"


def test_read_v2_docker():
    got = read_cgroup_memory(FIX / "v2_docker")
    assert (got.version, got.path, got.limit_bytes, got.limit_file) == (2, "/", 1_073_741_824, "memory.max")
    assert got.used_bytes == 421_527_552  # 570425344 - (157286400 - 8388608)


def test_read_v2_systemd_memory_high_is_lower():
    got = read_cgroup_memory(FIX / "v2_systemd_service")
    svc = "/sys/fs/cgroup/system.slice/ringlet.service"
    assert (got.limit_bytes, got.limit_file, got.limit_directory) == (3_758_096_384, "memory.high", svc)
    assert got.used_bytes == 3_523_215_360 - 2_147_483_648


def test_a_parents_limit_binds(tmp_path):
    root = copy("v2_systemd_service", tmp_path)
    (root / "sys/fs/cgroup/system.slice/memory.max").write_text("2147483648\n")
    got = read_cgroup_memory(root)
    assert (got.limit_bytes, got.limit_file, got.limit_directory) == (2_147_483_648, "memory.max",
                                                                      "/sys/fs/cgroup/system.slice")
    assert got.used_bytes == 6_442_450_944  # the slice's memory.current; no memory.stat there: all counted


def test_unlimited_everywhere(tmp_path):
    root = copy("v2_systemd_service", tmp_path)
    for name in ("memory.max", "memory.high"):
        (root / "sys/fs/cgroup/system.slice/ringlet.service" / name).write_text("max\n")
    got = read_cgroup_memory(root)
    assert got.limit_bytes is None and got.limit_file is None
    assert got.describe() == "cgroup v2 no limit (/sys/fs/cgroup/system.slice/ringlet.service)"
    v1 = copy("v1_host_hybrid", tmp_path)
    (v1 / f"sys/fs/cgroup/memory{JOB}/ringlet-a/memory.limit_in_bytes").write_text("9223372036854771712\n")
    stat = v1 / f"sys/fs/cgroup/memory{JOB}/ringlet-a/memory.stat"
    stat.write_text(stat.read_text().replace("hierarchical_memory_limit 3399999488",
                                             "hierarchical_memory_limit 9223372036854771712"))
    assert read_cgroup_memory(v1).limit_bytes is None


def test_v1_hierarchical_limit_of_an_ancestor_out_of_view(tmp_path):
    root = copy("v1_docker", tmp_path)
    stat = root / "sys/fs/cgroup/memory/memory.stat"
    stat.write_text(stat.read_text().replace("hierarchical_memory_limit 536870912",
                                             "hierarchical_memory_limit 268435456"))
    got = read_cgroup_memory(root)
    assert (got.limit_bytes, got.limit_file) == (268_435_456, "memory.stat hierarchical_memory_limit")


def test_odd_or_missing_files_count_as_absent(tmp_path):
    assert read_cgroup_memory(tmp_path) is None  # no /proc: not Linux
    root = copy("v2_docker", tmp_path)
    (root / "sys/fs/cgroup/memory.max").write_text("a lot\n")
    (root / "sys/fs/cgroup/memory.current").unlink()
    got = read_cgroup_memory(root)
    assert got.limit_bytes is None and got.used_bytes is None
    (root / "proc/self/cgroup").write_text("garbage\n")
    assert read_cgroup_memory(root) is None


def test_this_machine():
    """The live files: whatever this machine's layout, the reader finds the cgroup
    /proc/self/cgroup names, under the mount that holds it."""
    got = read_cgroup_memory()
    assert got is not None
    lines = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    assert got.path in {ln.path for ln in lines}
    assert Path(got.directory).is_dir()


# --------------------------------------------------------------------------- the usable-memory rule


HOST = 20_220_955_852  # 80 % of this machine's 25276194816 bytes
HOST_TEXT = "80% of total RAM (23.5 GiB): 18.8 GiB"


def test_cgroup_rule_lowest_wins_less_the_runtime_and_the_others():
    cg = read_cgroup_memory(FIX / "v1_host_hybrid")
    own = 204_877_824  # the captured process's RssAnon (200076 kB): at the first probe, the runtime
    usable, source, others = usable_with_cgroup(HOST, HOST_TEXT, cg, own)
    assert others == 208_252_928 - own == 3_375_104
    assert usable == int(3_399_999_488 * 0.8) - 3_375_104 - own == 2_511_746_662
    assert source == (f"cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory{JOB}/ringlet-a): 80% of 3.2 GiB "
                      "less 195 MiB the daemon's runtime and 3.2 MiB its other processes hold: 2.3 GiB")
    # later, 500 MB of weights loaded: the same figure (its own weights never shrink it)
    loaded = CgroupMemory(**{**cg.__dict__, "used_bytes": cg.used_bytes + 500_000_000})
    assert usable_with_cgroup(HOST, HOST_TEXT, loaded, own + 500_000_000, own)[0] == 2_511_746_662
    # the host binds lower: its rule stays, the cgroup's others are still reported
    assert usable_with_cgroup(1_000_000_000, "small host", cg, own) == (1_000_000_000, "small host", 3_375_104)
    assert usable_with_cgroup(HOST, HOST_TEXT, None, 0) == (HOST, HOST_TEXT, None)


def test_cgroup_rule_own_memory_is_not_the_others():
    cg = read_cgroup_memory(FIX / "v2_docker")
    usable, source, others = usable_with_cgroup(HOST, HOST_TEXT, cg, 500_000_000, 300_000_000)
    assert (usable, others) == (int(1_073_741_824 * 0.8) - 300_000_000, 0)  # it holds more than the cgroup's use
    assert source == "cgroup v2 memory.max (/sys/fs/cgroup): 80% of 1.0 GiB less 286 MiB the daemon's runtime: 533 MiB"
    usable, _, others = usable_with_cgroup(HOST, HOST_TEXT, cg, 0)  # a peer process holds it all
    assert (usable, others) == (int(1_073_741_824 * 0.8) - 421_527_552, 421_527_552)


def test_with_cgroup_on_a_probe(monkeypatch):
    monkeypatch.setattr(memory_mod, "own_anonymous_bytes", lambda: 0)
    host = MemoryInfo(total_bytes=25_276_194_816, available_bytes=1, usable_memory_bytes=HOST,
                      usable_rule="80% of total", usable_source=HOST_TEXT)
    got = with_cgroup(host, str(FIX / "v2_systemd_service"))
    serving = 32 << 20  # what the runtime grows by once serving (probes/memory.py SERVING_RUNTIME_BYTES)
    assert got.usable_memory_bytes == int(3_758_096_384 * 0.8) - 1_375_731_712 - serving
    assert got.usable_rule == "cgroup v2 memory.high"
    assert got.usable_source.startswith("cgroup v2 memory.high (/sys/fs/cgroup/system.slice/ringlet.service)")
    assert (got.cgroup_limit_bytes, got.cgroup_others_bytes, got.runtime_bytes) == (3_758_096_384, 1_375_731_712,
                                                                                     serving)
    monkeypatch.setattr(memory_mod, "own_anonymous_bytes", lambda: 100_000_000)  # weights loaded since
    again = with_cgroup(got, str(FIX / "v2_docker"))  # the host rule is recomputed, the runtime kept
    assert again.usable_memory_bytes == int(1_073_741_824 * 0.8) - (421_527_552 - 100_000_000) - serving
    assert again.runtime_bytes == serving
    assert with_cgroup(got, "/nonexistent") == replace(host, runtime_bytes=serving)
