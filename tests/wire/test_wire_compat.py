"""The wire format is checked, not remembered (issue #42, docs/wire-compat.md).

The current ``proto/ringlet.proto``, compiled as releases are kept, is compared with the
descriptor of every release in ``proto/released/`` of its protocol version (the releases a
node of this build may meet in one ring): a change an older node would misread, or an
addition it would silently ignore while the sender relies on it, fails unless the
protocol version is raised or ``ADDITIONS`` (daemon/wire/compat.py) names the capability
that guards it. Synthetic changes to a copy of the proto show that the check catches each
kind (run with ``-s`` to see the messages it gives).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import pytest

from ringlet.daemon.wire import compat, versions
from ringlet.daemon.wire.rpc.generate import PROTO_DIR, RELEASED_DIR, descriptor_set

RELEASES = compat.released(RELEASED_DIR)
LAST, LAST_FILE, LAST_PROTOCOL = RELEASES[-1]
PROTO = (PROTO_DIR / "ringlet.proto").read_text()


def against_last(proto_text: str | None = None, **kwargs) -> compat.Report:
    """The check of ``proto_text`` (default: the current proto) against the last release."""
    kwargs.setdefault("protocol", versions.PROTOCOL_VERSION)
    return compat.check(compat.load_set(LAST_FILE.read_bytes()), compat.load_set(descriptor_set(proto_text)),
                        release=LAST, release_protocol=LAST_PROTOCOL, **kwargs)


def edited(old: str, new: str, text: str = PROTO) -> str:
    """``text`` with one occurrence of ``old`` replaced (the edit must apply)."""
    assert text.count(old) == 1, old
    return text.replace(old, new)


#: Every release a node of this build may still share a ring with: those of its protocol
#: version (a node of an older one is kept out), and the last release whatever its version.
PEERS = [r for r in RELEASES if r[2] == versions.PROTOCOL_VERSION] or [RELEASES[-1]]


@pytest.mark.parametrize("release", PEERS, ids=[r[0] for r in PEERS])
def test_the_current_wire_against_every_release_it_may_meet(release):
    """Not only the last release: a node of 0.1.0 still joins a ring of this build when
    both speak the same protocol version, so what it lacks must be guarded too."""
    name, path, protocol = release
    report = compat.check(compat.load_set(path.read_bytes()), compat.load_set(descriptor_set()),
                          release=name, release_protocol=protocol, protocol=versions.PROTOCOL_VERSION)
    print(report.message())
    assert report.ok, report.message()
    if report.raised:
        warnings.warn(f"wire protocol {versions.PROTOCOL_VERSION} > release {name}'s {protocol}: every "
                      "difference passes (nodes of the two are kept apart)", stacklevel=1)


def test_every_release_descriptor_has_its_protocol_version_and_the_first_is_0_1_0():
    assert RELEASES[0][:1] == ("0.1.0",) and RELEASES[0][2] == 1
    for release, path, protocol in RELEASES:
        assert path.is_file(), f"{path} missing for release {release}"
        assert 1 <= protocol <= versions.PROTOCOL_VERSION
        assert compat.load_set(path.read_bytes()).file, path


def test_release_0_1_0_descriptor_is_that_commits_proto_compiled():
    """proto/released/0.1.0.binpb is what descriptor_set makes of the release commit's proto
    (where the history is at hand: a shallow clone skips)."""
    meta = (RELEASED_DIR / "0.1.0.json").read_text()
    commit = re.search(r'"commit": "([0-9a-f]{40})"', meta).group(1)
    root = PROTO_DIR.parent
    if shutil.which("git") is None or subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root,
                                                     capture_output=True).returncode != 0:
        pytest.skip(f"commit {commit[:9]} is not in this clone's history")
    text = subprocess.run(["git", "show", f"{commit}:proto/ringlet.proto"], cwd=root, capture_output=True,
                          text=True, check=True).stdout
    assert descriptor_set(text) == (RELEASED_DIR / "0.1.0.binpb").read_bytes()


def test_every_listed_addition_exists_and_names_a_capability_or_a_reason():
    current = compat.load_set(descriptor_set())
    names = set()
    for f in current.file:
        def walk(prefix, messages, enums):
            for e in enums:
                names.add(prefix + e.name)
                names.update(f"{prefix}{e.name}.{v.name}" for v in e.value)
            for m in messages:
                names.add(prefix + m.name)
                names.update(f"{prefix}{m.name}.{x.name}" for x in m.field)
                walk(f"{prefix}{m.name}.", m.nested_type, m.enum_type)
        walk(f"{f.package}.", f.message_type, f.enum_type)
        for s in f.service:
            names.add(f"{f.package}.{s.name}")
            names.update(f"{f.package}.{s.name}.{m.name}" for m in s.method)
    assert not set(compat.ADDITIONS) - names, f"ADDITIONS lists what the proto lacks: {set(compat.ADDITIONS) - names}"
    for path, guard in compat.ADDITIONS.items():
        assert guard in versions.CAPABILITIES or (guard.startswith(compat.INFORMATIONAL)
                                                 and len(guard) > len(compat.INFORMATIONAL) + 10), (path, guard)


def test_what_the_wire_gained_since_0_1_0_is_each_guarded_by_its_capability():
    """The additions issue #42 names (drafts was relied on unguarded) are found and guarded."""
    report = compat.check(compat.load_set((RELEASED_DIR / "0.1.0.binpb").read_bytes()),
                          compat.load_set(descriptor_set()), release="0.1.0", release_protocol=1)
    guards = {c.path: c.guard for c in report.changes}
    assert guards["ringlet.v1.Activation.drafts"] == versions.DRAFTS
    assert guards["ringlet.v1.GenerateRequest.prediction"] == versions.DRAFTS
    assert guards["ringlet.v1.GenerateEvent.progress"] == versions.PREFILL_PROGRESS
    assert guards["ringlet.v1.PrefillProgress"] == versions.PREFILL_PROGRESS
    assert guards["ringlet.v1.Heartbeat.membership_digest"] == versions.RECONCILE
    assert guards["ringlet.v1.Vote.members"] == versions.RECONCILE
    assert "ringlet.v1.PrefillProgress.processed" not in guards  # comes with its message
    # without the registry, the same wire fails: every one of them is an unguarded addition
    bare = compat.check(compat.load_set((RELEASED_DIR / "0.1.0.binpb").read_bytes()),
                        compat.load_set(descriptor_set()), release="0.1.0", release_protocol=1, additions={})
    assert not bare.ok and {c.path for c in bare.unguarded} == set(guards)


# -- synthetic changes: each kind is caught -----------------------------------------------

ACTIVATION_END = "  repeated TokenScores token_scores = 24;\n}"

BREAKING = {  # each edits what release 0.1.0 already had
    "renumbered": (edited("repeated string batch_ids = 21;", "repeated string batch_ids = 31;"),
                   "ringlet.v1.Activation.batch_ids: renumbered from 21 to 31"),
    "removed": (edited("  string cache_scope = 8;", "  // cache_scope"),
                "ringlet.v1.GenerateRequest.cache_scope: field 8 removed"),
    "type": (edited("uint32 steps_done = 7;", "uint64 steps_done = 7;"),
             "ringlet.v1.GenerateRequest.steps_done: type changed from uint32 to uint64"),
    "label": (edited("repeated int32 stop_ids = 5;", "int32 stop_ids = 5;"),
              "ringlet.v1.GenerateRequest.stop_ids: label changed from repeated to optional"),
    "renamed": (edited("uint32 steps_done = 7;", "uint32 tokens_done = 7;"),
                "ringlet.v1.GenerateRequest.steps_done: field 7 renamed to 'tokens_done'"),
    "oneof": (edited("  double ttft_s = 3;  // set on the first token only\n", "",
                     edited("    int32 token = 1;\n", "    int32 token = 1;\n    double ttft_s = 3;\n")),
              "ringlet.v1.GenerateEvent.ttft_s: oneof changed from (none) to event"),
    "method removed": (edited("  rpc Echo(Ping) returns (Ping);\n", ""), "ringlet.v1.Ring.Echo: method removed"),
    "method type": (edited("rpc Echo(Ping) returns (Ping);", "rpc Echo(Ping) returns (stream Ping);"),
                    "ringlet.v1.Ring.Echo: changed from (ringlet.v1.Ping) returns (ringlet.v1.Ping) to "
                    "(ringlet.v1.Ping) returns (stream ringlet.v1.Ping)"),
}

ADDED = {
    "field": (edited(ACTIVATION_END, ACTIVATION_END[:-1] + "  uint32 lookahead = 25;\n}"),
              "ringlet.v1.Activation.lookahead"),
    "method": (edited("  rpc Echo(Ping) returns (Ping);\n", "  rpc Echo(Ping) returns (Ping);\n"
                      "  rpc Echo2(Ping) returns (Ping);\n"), "ringlet.v1.Ring.Echo2"),
    "message": (PROTO + "\nmessage Hint {\n  string text = 1;\n}\n", "ringlet.v1.Hint"),
}


@pytest.mark.parametrize("kind", BREAKING)
def test_a_breaking_change_fails_unless_the_protocol_version_is_raised(kind):
    text, expected = BREAKING[kind]
    report = against_last(text)
    print(f"\n--- {kind} ---\n{report.message()}")
    assert not report.ok and expected in report.message()
    assert [c.path for c in report.breaking] == [expected.split(":")[0]]
    assert "raise PROTOCOL_VERSION" in report.message()
    raised = against_last(text, protocol=LAST_PROTOCOL + 1)
    assert raised.ok and "are kept apart" in raised.message()


@pytest.mark.parametrize("kind", ADDED)
def test_an_addition_fails_until_it_is_guarded(kind):
    text, path = ADDED[kind]
    report = against_last(text)
    print(f"\n--- added {kind} ---\n{report.message()}")
    assert not report.ok and [c.path for c in report.unguarded] == [path]
    assert "added without a guard" in report.message() and path in report.message()
    unknown = against_last(text, additions={**compat.ADDITIONS, path: "lookahead"})
    assert not unknown.ok and "not a capability of this build" in unknown.message()
    assert against_last(text, additions={**compat.ADDITIONS, path: versions.DRAFTS}).ok
    reason = compat.INFORMATIONAL + "a hint for logs; an older node may ignore it"
    assert against_last(text, additions={**compat.ADDITIONS, path: reason}).ok
    assert against_last(text, protocol=LAST_PROTOCOL + 1).ok


def test_cutting_a_release_keeps_the_current_descriptor_with_the_protocol_version(tmp_path, monkeypatch):
    """``generate --release`` (docs/wire-compat.md, Cutting a release) writes what this test
    reads: the current descriptor and pyproject.toml's version with PROTOCOL_VERSION."""
    import tomllib

    from ringlet.daemon.wire.rpc import generate

    monkeypatch.setattr(generate, "RELEASED_DIR", tmp_path)
    assert generate.main(["--release"]) == 0
    version = tomllib.loads((PROTO_DIR.parent / "pyproject.toml").read_text())["project"]["version"]
    ((release, path, protocol),) = compat.released(tmp_path)
    assert (release, path.name, protocol) == (version, f"{version}.binpb", versions.PROTOCOL_VERSION)
    assert path.read_bytes() == descriptor_set()
    assert compat.check(compat.load_set(path.read_bytes()), compat.load_set(descriptor_set()), release=release,
                        release_protocol=protocol).changes == []


@pytest.mark.parametrize("old, new, path", [
    ("uint32 protocol_version = 2;", "uint64 protocol_version = 2;", "ringlet.v1.NodeInfo.protocol_version"),
    ("string record_json = 13;", "string record_json = 17;", "ringlet.v1.NodeInfo.record_json"),
    ("rpc GetNodeInfo(NodeInfoRequest) returns (NodeInfo);", "rpc GetNodeInfo(NodeInfoRequest) returns (Ping);",
     "ringlet.v1.Ring.GetNodeInfo"),
])
def test_the_handshake_reads_the_same_in_every_protocol_version(old, new, path):
    """A node tells a peer of another protocol version through GetNodeInfo: changing what it
    reads fails even with the protocol version raised."""
    text = edited(old, new)
    for protocol in (LAST_PROTOCOL, LAST_PROTOCOL + 1):
        report = against_last(text, protocol=protocol)
        print(f"\n--- handshake, protocol {protocol} ---\n{report.message()}")
        assert not report.ok and [c.path for c in report.handshake] == [path]
        assert "changes the handshake" in report.message()


def test_every_handshake_name_is_in_the_current_proto():
    current = compat.load_set(descriptor_set())
    (f,) = current.file
    names = {f"{f.package}.{m.name}" for m in f.message_type}
    names |= {f"{f.package}.{m.name}.{x.name}" for m in f.message_type for x in m.field}
    names |= {f"{f.package}.{s.name}" for s in f.service}
    names |= {f"{f.package}.{s.name}.{m.name}" for s in f.service for m in s.method}
    assert compat.HANDSHAKE <= names, compat.HANDSHAKE - names
