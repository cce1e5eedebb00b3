"""The lock and pyproject.toml agree (issue #42): every requirement pyproject.toml names, for
every platform the lock covers, is pinned in requirements.lock to a version its range
allows, with hashes; the lock pins nothing twice for one platform; the model package's
lock pins the Makefile's MODEL_PKG; the installed environment is the locked one; the
runtime lock is the lock's runtime part; the agent CLIs' npm lock pins what docs say.

Expected values come from pyproject.toml and the Makefile, read here with ``packaging``
(the same library pip uses), not from ringlet's code.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
#: The platforms the universal lock covers: Linux (x86-64, arm64) and macOS (arm64), the
#: Python versions pyproject.toml allows that exist today.
ENVIRONMENTS = [
    {"sys_platform": sys_platform, "platform_system": system, "platform_machine": machine, "os_name": "posix",
     "python_version": py, "python_full_version": f"{py}.0", "implementation_name": "cpython",
     "platform_python_implementation": "CPython"}
    for sys_platform, system, machine in (("linux", "Linux", "x86_64"), ("linux", "Linux", "aarch64"),
                                          ("darwin", "Darwin", "arm64"))
    for py in ("3.11", "3.12", "3.13")
]


def parse_lock(path: Path) -> list[tuple[str, Version, Marker | None, int]]:
    """(name, version, marker, number of hashes) of each pin in a hashed requirements file."""
    text = path.read_text()
    pins = []
    for block in re.split(r"\n(?=\S)", text):
        line = block.split("\\", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{line}: not pinned"
        pins.append((canonicalize_name(req.name), Version(spec.version), req.marker, block.count("--hash=sha256:")))
    return pins


def pins_for(pins, env) -> dict[str, Version]:
    out: dict[str, Version] = {}
    for name, version, marker, _ in pins:
        if marker is None or marker.evaluate(env):
            assert name not in out, f"{name} pinned twice for {env['sys_platform']}/{env['python_version']}"
            out[name] = version
    return out


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
    return reqs


LOCK = parse_lock(ROOT / "requirements.lock")


def test_every_pin_has_hashes():
    assert LOCK
    assert all(hashes >= 1 for _, _, _, hashes in LOCK), [n for n, _, _, h in LOCK if not h]


@pytest.mark.parametrize("env", ENVIRONMENTS, ids=lambda e: f"{e['sys_platform']}-{e['platform_machine']}-"
                                                          f"{e['python_version']}")
def test_every_requirement_is_pinned_within_its_range(env):
    pinned = pins_for(LOCK, env)
    wrong = []
    for req in project_requirements():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name not in pinned:
            wrong.append(f"{req} is not in requirements.lock (run `make lock`)")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            wrong.append(f"{req}: the lock pins {pinned[name]} (run `make lock`)")
        for extra in req.extras:  # mlx[cpu] -> mlx-cpu on Linux
            if name == "mlx" and extra == "cpu" and canonicalize_name("mlx-cpu") not in pinned:
                wrong.append(f"{req}: mlx-cpu is not in the lock")
    assert not wrong, wrong


def via(path: Path) -> dict[str, set[str]]:
    """Each pin's ``# via`` annotation (uv writes why it pinned a package): the names of the
    packages that need it, ``ringlet`` for pyproject.toml itself."""
    out: dict[str, set[str]] = {}
    for block in re.split(r"\n(?=\S)", path.read_text()):
        head = block.split("\\", 1)[0].strip()
        if not head or head.startswith("#"):
            continue
        name = canonicalize_name(Requirement(head).name)
        why = re.findall(r"#\s+(?:via\s+)?([A-Za-z0-9_.\-\[\]]+)(?:\s+\(pyproject\.toml\))?\s*$", block, re.M)
        out[name] = {canonicalize_name(w.split("[")[0]) for w in why if w != "via"}  # "# via" alone heads a list
    return out


def test_the_lock_names_nothing_pyproject_does_not_need():
    """Every pin is wanted by pyproject.toml or by another pin; a pin wanted by pyproject.toml
    is named there (a dependency dropped from pyproject.toml must leave the lock too)."""
    named = {canonicalize_name(r.name) for r in project_requirements()}
    reasons = via(ROOT / "requirements.lock")
    pinned = set(reasons)
    stray = {name: why for name, why in reasons.items()
             if not why or not why <= pinned | {"ringlet"} or ("ringlet" in why and name not in named)}
    assert not stray, stray


def test_model_lock_pins_the_makefiles_model_package():
    make = (ROOT / "Makefile").read_text()
    model = re.search(r"^MODEL_PKG := (\S+)==(\S+)$", make, re.M)
    (pin,) = parse_lock(ROOT / "requirements-model.lock")
    assert (pin[0], pin[1]) == (canonicalize_name(model.group(1)), Version(model.group(2)))
    assert pin[3] >= 1


def test_installed_environment_is_the_locked_one():
    """What `make install` put in this venv is exactly what the lock names for it."""
    import platform
    import sys

    env = {"sys_platform": sys.platform, "platform_system": platform.system(),
           "platform_machine": platform.machine(), "os_name": "posix",
           "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
           "python_full_version": platform.python_version(), "implementation_name": sys.implementation.name,
           "platform_python_implementation": platform.python_implementation()}
    differ = []
    for name, version in pins_for(LOCK, env).items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            differ.append(f"{name} {version} is not installed")
            continue
        if installed != version:
            differ.append(f"{name}: installed {installed}, locked {version}")
    assert not differ, differ


RUNTIME_LOCK = parse_lock(ROOT / "requirements-runtime.lock")


@pytest.mark.parametrize("env", ENVIRONMENTS, ids=lambda e: f"{e['sys_platform']}-{e['platform_machine']}-"
                                                          f"{e['python_version']}")
def test_runtime_lock_is_the_locks_runtime_part(env):
    """requirements-runtime.lock (what make wheel-check installs beside the built wheel) pins
    every runtime requirement, with hashes, at the version requirements.lock pins it; it
    pins nothing the test or dev extras alone need."""
    assert all(hashes >= 1 for _, _, _, hashes in RUNTIME_LOCK)
    runtime, full = pins_for(RUNTIME_LOCK, env), pins_for(LOCK, env)
    differ = {name: (str(v), str(full.get(name))) for name, v in runtime.items() if full.get(name) != v}
    assert not differ, f"run `make lock`: runtime pin vs requirements.lock: {differ}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for req in map(Requirement, project["dependencies"]):
        if req.marker is None or req.marker.evaluate(env):
            assert canonicalize_name(req.name) in runtime, f"{req} is not in requirements-runtime.lock (`make lock`)"
    assert not {"pytest", "ruff", "hypothesis", "grpcio-tools", "uv", "build"} & set(runtime), sorted(runtime)


def test_agent_clis_are_pinned_exactly_in_the_committed_npm_lock():
    """tests/agents/npm: package.json pins exact versions, its lock (made by npm) resolves
    each to that version with an integrity hash, and docs/agents.md names the same ones."""
    import json

    npm = ROOT / "tests" / "agents" / "npm"
    wanted = json.loads((npm / "package.json").read_text())["dependencies"]
    lock = json.loads((npm / "package-lock.json").read_text())
    assert lock["lockfileVersion"] >= 3 and lock["packages"][""]["dependencies"] == wanted
    for name, version in wanted.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name}: {version} is not an exact version"
        entry = lock["packages"][f"node_modules/{name}"]
        assert entry["version"] == version and entry["integrity"].startswith("sha512-"), name
    assert all(p.get("integrity") for key, p in lock["packages"].items() if key), "a locked package without a hash"
    docs = (ROOT / "docs" / "agents.md").read_text()
    for name, version in wanted.items():
        assert f"`{name}` {version}" in docs, f"docs/agents.md does not name {name} {version}"
