"""``ringlet doctor``: every check prints a result on this machine without a traceback,
the exit status follows FAIL only, and each check's verdicts (ports, model, interfaces,
firewall, Thunderbolt Bridge loop, wired limit) on real sockets or simulated probes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_status import FakeNode, today_info

from ringlet.daemon.ops.doctor import command, config, machine, network
from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Context
from ringlet.daemon.probes.common import ThunderboltPort
from ringlet.daemon.probes.macos_ifconfig import MacIfconfig
from ringlet.daemon.probes.macos_thunderbolt import MacThunderbolt
from ringlet.daemon.probes.memory import MemoryInfo

GIB = 1 << 30
NAMES = [name for name, _ in command.CHECKS]


def run_doctor(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["HOME"] = str(home)
        env.pop("XDG_CONFIG_HOME", None)
    return subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def this_machine(tmp_path_factory):
    from tiny_models import make_tiny_model

    home = tmp_path_factory.mktemp("home")
    text = run_doctor(home=home)  # this machine as it is: the default model
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")  # quicker to read
    as_json = run_doctor("--json", "--model", str(tiny), home=home)
    return text, as_json


def test_every_check_prints_a_result_without_a_traceback(this_machine):
    r, _ = this_machine
    assert "Traceback" not in r.stdout + r.stderr
    rows = re.findall(r"^(OK|WARN|FAIL)\s+(\S.*?)\s{2,}", r.stdout, flags=re.M)
    assert [name for _, name in rows] == NAMES, r.stdout
    for status, _ in rows:
        assert status in (OK, WARN, FAIL)
    fails = sum(status == FAIL for status, _ in rows)
    assert r.returncode == (1 if fails else 0), r.stdout
    assert re.search(rf"{len(NAMES)} checks: \d+ OK, \d+ WARN, {fails} FAIL", r.stdout)
    # every WARN and FAIL comes with a fix
    for block in re.split(r"^(?=OK|WARN|FAIL)", r.stdout, flags=re.M):
        if block.startswith(("WARN", "FAIL")):
            assert "fix:" in block, block


def test_json_output_matches(this_machine):
    text, r = this_machine
    data = json.loads(r.stdout)
    assert [c["name"] for c in data["checks"]] == NAMES
    assert data["failed"] == any(c["status"] == FAIL for c in data["checks"])
    assert r.returncode == (1 if data["failed"] else 0)
    model = next(c for c in data["checks"] if c["name"] == "model")
    assert model["status"] == OK and "4 layers" in model["summary"] and model["details"]["bytes"] > 0


def test_a_missing_model_fails_with_exit_1(tmp_path):
    r = run_doctor("--model", str(tmp_path / "no-such-model"), home=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert re.search(r"^FAIL\s+model\s+", r.stdout, flags=re.M)


def test_a_missing_second_model_fails_naming_it(tmp_path):
    """A node of several models (``--model`` repeated, as ``ringlet run`` takes it) is checked
    model by model: the first is found, the second is not, and the FAIL names the second."""
    missing = tmp_path / "no-such-second-model"
    r = run_doctor("--model", "smollm2-135m", "--model", str(missing), "--json", home=tmp_path)
    model = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "model")
    assert r.returncode == 1 and model["status"] == FAIL and str(missing) in model["summary"], model


@pytest.mark.parametrize("args", [["--port", "0"], ["--api-port", "x"]])
def test_bad_input_is_one_error_line(args, tmp_path):
    r = run_doctor(*args, home=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def ctx(**kw) -> Context:
    return Context(platform=kw.pop("platform", sys.platform), **kw)


def test_ports_busy_is_a_fail_with_the_fix():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        c = network.check_ports(ctx(port=s.getsockname()[1], api_port=s.getsockname()[1]))
    finally:
        s.close()
    assert c.status == FAIL and "in use" in c.summary.lower() and "--port" in c.fix


def test_ports_held_by_the_ringlet_daemon_doctor_checks_are_ok():
    """doctor run beside its daemon (the README's advice) does not warn about that daemon's
    own ports; it says a second daemon would need others."""
    with FakeNode(today_info(0, n=1)) as node:
        c = network.check_ports(ctx(port=node.port, api_port=node.port))
        d = network.check_daemon(ctx(api_port=node.port))
    assert c.status == OK and "held by the running ringlet daemon" in c.summary and "--data-dir" in c.summary
    assert d.status == OK and "127.0.0.1:7100" in d.summary and "ready" in d.summary


def test_free_ports_are_ok():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert network.check_ports(ctx(port=port, api_port=port)).status == OK


def test_interfaces():
    assert network.check_multicast(ctx(interfaces=["lo"])).status in (OK, WARN)  # WARN only if 5353 is taken
    bad = network.check_multicast(ctx(interfaces=["nosuch0"]))
    assert bad.status == FAIL and "no such interface" in bad.summary and bad.fix
    assert network.check_multicast(ctx(interfaces=["127.0.0.1"])).summary.startswith(("mDNS on lo", "mDNS on"))


def test_no_interface_up_is_a_warning(monkeypatch):
    monkeypatch.setattr(network, "_interfaces_info", lambda: {"lo": {"up": True, "flags": {"up", "loopback"},
                                                                     "ipv4": ["127.0.0.1"], "loopback": True}})
    c = network.check_multicast(ctx())
    assert c.status == WARN and "--peers" in c.fix


def mac_memory(total_gib: int, wired_gib: int | None = None, ws_gib: int | None = None) -> MemoryInfo:
    return MemoryInfo(total_bytes=total_gib * GIB, available_bytes=total_gib * GIB // 2,
                      usable_memory_bytes=(wired_gib or ws_gib or total_gib) * GIB, usable_rule="x",
                      wired_limit_bytes=wired_gib * GIB if wired_gib else None,
                      max_recommended_working_set_bytes=ws_gib * GIB if ws_gib else None)


def test_wired_limit_advice(monkeypatch):
    import ringlet.daemon.probes.memory as memory

    assert machine.recommended_wired_limit_mb(192 * GIB) == (192 * GIB - 192 * GIB // 10) // (1 << 20)
    assert machine.recommended_wired_limit_mb(512 * GIB) == (512 - 24) * 1024  # at most 24 GiB kept back
    assert machine.recommended_wired_limit_mb(16 * GIB) == (16 - 6) * 1024  # at least 6 GiB kept back
    monkeypatch.setattr(memory, "probe_memory", lambda platform=None: mac_memory(192, ws_gib=144))
    big = machine.check_wired_limit(ctx(platform="darwin", model_bytes=140 * GIB))
    assert big.status == WARN and "sudo sysctl iogpu.wired_limit_mb=176947" in big.fix
    small = machine.check_wired_limit(ctx(platform="darwin", model_bytes=4 * GIB))
    assert small.status == OK and "iogpu.wired_limit_mb=" in small.summary
    monkeypatch.setattr(memory, "probe_memory", lambda platform=None: mac_memory(192, wired_gib=180))
    assert machine.check_wired_limit(ctx(platform="darwin", model_bytes=140 * GIB)).status == OK
    assert "macOS only" in machine.check_wired_limit(ctx(platform="linux")).summary


def tb_port(n: int, iface: str, peer: str | None, live: bool = True) -> ThunderboltPort:
    return ThunderboltPort(port_id=str(n), interface=iface, own_domain_uuid="A" * 8, peer_domain_uuid=peer,
                           link_speed_bytes_per_s=5_000_000_000 if live else None, speed_text="40 Gb/s",
                           peer_name="Mac Studio")


def test_thunderbolt_bridge_loop_is_a_warning(monkeypatch):
    import ringlet.daemon.probes.macos_thunderbolt as mtb

    bridge = MacIfconfig(name="bridge0", flags=("UP", "RUNNING"), mtu=1500, members=("en1", "en2"),
                         status="active")
    looped = MacThunderbolt(ports=(tb_port(1, "en1", "B" * 8), tb_port(2, "en2", "C" * 8)), bridge=bridge)
    monkeypatch.setattr(mtb, "probe_macos_thunderbolt", lambda timeout=20.0: looped)
    c = network.check_thunderbolt(ctx(platform="darwin"))
    assert c.status == WARN and "loop" in c.summary and "Thunderbolt Bridge" in c.fix
    one = MacThunderbolt(ports=(tb_port(1, "en1", "B" * 8), tb_port(2, "en2", None, live=False)), bridge=bridge)
    monkeypatch.setattr(mtb, "probe_macos_thunderbolt", lambda timeout=20.0: one)
    assert network.check_thunderbolt(ctx(platform="darwin")).status == OK
    monkeypatch.setattr(mtb, "probe_macos_thunderbolt", lambda timeout=20.0: None)
    assert network.check_thunderbolt(ctx(platform="darwin")).status == WARN


@pytest.mark.parametrize("outputs, status", [
    ({"--getglobalstate": "Firewall is disabled. (State = 0)"}, OK),
    ({"--getglobalstate": "Firewall is enabled. (State = 1)", "--getblockall": "Block all DISABLED!"}, WARN),
    ({"--getglobalstate": "Firewall is enabled. (State = 1)",
      "--getblockall": "Firewall has block all state set to enabled."}, FAIL),
    ({"--getglobalstate": "Firewall is blocking all non-essential incoming connections. (State = 2)",
      "--getblockall": ""}, FAIL),
    ({"--getglobalstate": "???"}, WARN),
])
def test_macos_firewall(monkeypatch, outputs, status):
    monkeypatch.setattr(network, "run_command", lambda cmd, timeout=10.0: (0, outputs.get(cmd[-1], "")))
    c = network.check_firewall(ctx(platform="darwin"))
    assert c.status == status, c
    if status != OK:
        assert c.fix


def test_secret(tmp_path):
    assert config.check_secret(ctx()).status == WARN
    missing = config.check_secret(ctx(secret_file=str(tmp_path / "nope")))
    assert missing.status == FAIL and "ringlet secret new" in missing.fix
    good = tmp_path / "s"
    good.write_text("ab" * 32 + "\n")
    good.chmod(0o600)
    assert config.check_secret(ctx(secret_file=str(good))).status == OK
    good.chmod(0o644)
    assert config.check_secret(ctx(secret_file=str(good))).status in (WARN, FAIL)


def test_a_check_that_breaks_is_a_warning_not_a_traceback(monkeypatch):
    def boom(_ctx):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(command, "CHECKS", [("memory", boom), ("disk space", machine.check_disk)])
    results = command.run_checks(ctx())
    assert results[0].status == WARN and "probe exploded" in results[0].summary
    assert results[1].name == "disk space"


def test_options_default_to_the_service_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    cdir = tmp_path / ".config" / "ringlet"
    cdir.mkdir(parents=True)
    (cdir / "service.toml").write_text('model = "/models/x"\napi_port = 8123\ninterfaces = ["lo"]\n')
    import argparse

    ns = argparse.Namespace(model=None, interface=None, host=None, port=None, api_port=None, data_dir=None,
                            secret_file=None, json=False)
    c = command.make_context(ns)
    assert (c.model, c.api_port, c.interfaces, c.port) == ("/models/x", 8123, ["lo"], 7100)
    assert c.config_source == str(cdir / "service.toml")
    ns.api_port = "9000"
    assert command.make_context(ns).api_port == 9000


def test_blas_and_dtype_are_reported_with_the_fix_on_the_slow_path(tmp_path):
    """The BLAS and dtype checks on this machine: the system OpenBLAS (installed by make
    install) is OK; RINGLET_BLAS pointing at a missing file is the slow path, a WARN whose
    fix names the package. --dtype auto on this CPU loads the bundled Q4 model as float32,
    and after one ``ringlet generate`` the dequantized-weights cache holds all of its layer
    files: 30 layers + the embedding + the final norm (the head is tied) = 32."""
    import ctypes.util

    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("XDG_CACHE_HOME", None)  # this HOME's machine cache: empty before the generate
    env.pop("RINGLET_WEIGHTS_CACHE_BYTES", None)
    gen = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "generate", "--max-tokens", "1", "Hi"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert gen.returncode == 0, gen.stderr
    good = json.loads(subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "doctor", "--json"],
                                     capture_output=True, text=True, timeout=180, env=env).stdout)
    checks = {c["name"]: c for c in good["checks"]}
    dtype = checks["dtype"]
    assert dtype["status"] == OK and dtype["details"]["loaded"] == "float32" and "auto" in dtype["summary"]
    cache = dtype["details"]["weights_cache"]
    assert (cache["files"], cache["of"]) == (32, 32), cache
    assert cache["path"].startswith(str(tmp_path / ".cache" / "ringlet" / "dequant")) and cache["path"] in \
        dtype["summary"].replace("\n", "")
    # by hand: 30 x 3,540,096 + 49,152 x 576 + 576 = 134,515,008 float32 weights, plus 32 small headers
    assert 538_060_032 <= cache["bytes"] < 538_060_032 + 32 * 64 * 1024, cache
    if ctypes.util.find_library("openblas"):
        assert checks["blas"]["status"] == OK and "openblas" in checks["blas"]["summary"].lower()
        assert checks["blas"]["details"]["library"] in checks["blas"]["details"]["mapped"]
        assert "through its sgemv" in checks["blas"]["summary"]
        # a machine without a C compiler (and nothing built yet): the decode path's fix
        bare = tmp_path / "bare"
        (bare / "bin").mkdir(parents=True)
        nocc = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "doctor"], capture_output=True,
                              text=True, timeout=180, env={**env, "HOME": str(bare), "PATH": str(bare / "bin"),
                                                           "CC": "/nonexistent/cc"})
        block = re.search(r"^WARN\s+blas\b.*?(?=^(?:OK|WARN|FAIL)\s)", nocc.stdout, flags=re.M | re.S)
        assert block, nocc.stdout
        text = " ".join(block.group(0).split())
        assert "through its sgemm" in text and "no C compiler" in text and "apt-get install gcc" in text
    env["RINGLET_BLAS"] = str(tmp_path / "missing-libblas.so")
    bad = subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", "doctor"], capture_output=True,
                         text=True, timeout=180, env=env)
    block = re.search(r"^WARN\s+blas\b.*?(?=^(?:OK|WARN|FAIL)\s)", bad.stdout, flags=re.M | re.S)
    assert block, bad.stdout
    assert "bundled reference BLAS" in block.group(0) and "missing-libblas.so" in block.group(0).replace("\n", "")
    assert "fix:" in block.group(0) and "libopenblas0-pthread" in block.group(0)


def test_versions_check_names_what_to_upgrade():
    """The versions check against a daemon's /v1/cluster (a real HTTP server): the same
    release everywhere is OK; a rolling upgrade under way names the nodes still behind; a
    daemon older than the installed package is told to restart; a member kept out for its
    protocol version FAILs with the reason."""
    from ringlet.daemon.ops.doctor import versions

    def info(releases, running="0.2.0", **extra):
        members = [{"node_id": f"n{k}", "name": f"studio-{k + 1}", "release": r, "protocol_version": 1}
                   for k, r in enumerate(releases)]
        return today_info(0, n=1, release=running, protocol_version=1, members=members, **extra)

    same = info(["0.2.0", "0.2.0"])
    with FakeNode(same) as node:
        c = versions.check_versions(ctx(api_port=node.port))
    assert c.status == OK and "the daemon runs 0.2.0" in c.summary and "0.2.0 on studio-1, studio-2" in c.summary
    assert versions.versions_verdict(None, installed="0.2.0").status == OK

    rolling = versions.versions_verdict(info(["0.2.0", "0.1.0", "0.1.0"]), installed="0.2.0")
    assert rolling.status == WARN and "upgrade studio-2, studio-3 to 0.2.0" in rolling.fix
    old_daemon = versions.versions_verdict(info(["0.1.0"], running=None), installed="0.2.0")
    assert old_daemon.status == WARN and "the daemon runs 0.1.0" in old_daemon.summary
    assert "restart" in old_daemon.fix
    reason = "n9 runs ringlet 0.3.0 with wire protocol 2; this node runs 0.2.0 with protocol 1: ..."
    out = versions.versions_verdict(info(["0.2.0"], incompatible=[{"node_id": "n9", "reason": reason}]),
                                    installed="0.2.0")
    assert out.status == FAIL and reason in out.summary
    assert versions.versions_verdict("could not read /v1/cluster: x", installed="0.2.0").status == WARN
