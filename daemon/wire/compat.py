"""The wire format, checked against the last release's (docs/wire-compat.md).

``proto/released/<release>.binpb`` is the compiled descriptor of each release's
``proto/ringlet.proto`` (beside it ``<release>.json``: its wire protocol version).
:func:`check` compares the current descriptor with the last release's and classifies
every difference:

- **needs a new protocol version**: a field removed, renumbered or renamed, its type,
  label, presence or oneof changed; a message, enum, enum value, service or method
  removed; a method's request or response type or streaming changed. An older node
  would misread such a message (or the sender would misread the older node's).
- **an addition**: a field, message, enum value, service or method the release did not
  have. An older node ignores an unknown field and refuses an unknown method, so an
  addition is allowed only when :data:`ADDITIONS` says why that is safe: the capability
  (:mod:`ringlet.daemon.wire.versions`) without which no node sends it, or
  ``"informational: ..."``, why an older node may ignore it.

When :data:`~ringlet.daemon.wire.versions.PROTOCOL_VERSION` is above the release's,
nodes of the two never share a ring and every difference is allowed (the report says so),
except to the handshake (:data:`HANDSHAKE`): a node learns a peer's protocol version
through it, so it must read the same in every protocol version.
``tests/wire/test_wire_compat.py`` runs the check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import descriptor_pb2

from ringlet.daemon.wire import versions

#: An :data:`ADDITIONS` value that guards nothing: an older node may ignore the addition,
#: and the sender relies on nothing when it does. Followed by the reason.
INFORMATIONAL = "informational: "

#: Everything the wire gained since release 0.1.0, by full name (``package.Message.field``,
#: ``package.Message``, ``package.Enum.VALUE``, ``package.Service.Method``), and why an
#: older node is safe with it: the capability a node checks the peer for before it sends
#: or relies on it, or :data:`INFORMATIONAL` and the reason. Fields of an added message
#: come with it. Entries stay when a release is cut: they document the wire.
ADDITIONS: dict[str, str] = {
    # speculative decoding: stage 0 drafts only when every stage verifies and trims
    "ringlet.v1.Activation.drafts": versions.DRAFTS,
    "ringlet.v1.Activation.tokens": versions.DRAFTS,
    "ringlet.v1.Activation.token_scores": versions.DRAFTS,
    "ringlet.v1.GenerateRequest.prediction": versions.DRAFTS,
    "ringlet.v1.GenerateEvent.accepted_drafts": versions.DRAFTS,
    "ringlet.v1.GenerateEvent.rejected_drafts": versions.DRAFTS,
    "ringlet.v1.GenerateEvent.draft_trips": versions.DRAFTS,
    # an event with neither token nor error would puzzle an older API node
    "ringlet.v1.GenerateEvent.progress": versions.PREFILL_PROGRESS,
    "ringlet.v1.PrefillProgress": versions.PREFILL_PROGRESS,
    # refused proposals reconcile the views
    "ringlet.v1.Heartbeat.membership_digest": versions.RECONCILE,
    "ringlet.v1.Vote.members": versions.RECONCILE,
}

#: What the handshake reads, which every protocol version must read the same: a node of
#: another protocol version is told apart and kept out through it (``GetNodeInfo``: its
#: id, cluster, protocol version and record). A difference here fails whatever the
#: protocol version.
HANDSHAKE: frozenset[str] = frozenset({
    "ringlet.v1.Ring", "ringlet.v1.Ring.GetNodeInfo", "ringlet.v1.NodeInfoRequest", "ringlet.v1.NodeInfo",
    "ringlet.v1.NodeInfoRequest.caller_id", "ringlet.v1.NodeInfoRequest.caller_address",
    "ringlet.v1.NodeInfo.node_id", "ringlet.v1.NodeInfo.protocol_version", "ringlet.v1.NodeInfo.cluster_id",
    "ringlet.v1.NodeInfo.record_json",
})

_TYPES = {v: k.removeprefix("TYPE_").lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
_LABELS = {v: k.removeprefix("LABEL_").lower() for k, v in descriptor_pb2.FieldDescriptorProto.Label.items()}


@dataclass(frozen=True)
class Change:
    """One difference between the release's descriptor and the current one."""

    path: str       #: full name of what changed
    what: str       #: what happened to it, for people
    breaking: bool  #: an older node would misread it: needs a new protocol version
    guard: str | None = None  #: an addition's :data:`ADDITIONS` entry (None: not listed)

    @property
    def guarded(self) -> bool:
        """An addition listed with a capability this build has, or as informational."""
        return not self.breaking and self.guard is not None and (
            self.guard in versions.CAPABILITIES or self.guard.startswith(INFORMATIONAL))


@dataclass
class Report:
    """The classified differences and whether the current wire may ship with them."""

    release: str
    release_protocol: int
    protocol: int
    changes: list[Change] = field(default_factory=list)

    @property
    def breaking(self) -> list[Change]:
        return [c for c in self.changes if c.breaking]

    @property
    def unguarded(self) -> list[Change]:
        return [c for c in self.changes if not c.breaking and not c.guarded]

    @property
    def handshake(self) -> list[Change]:
        """Breaking changes to what every protocol version must read (:data:`HANDSHAKE`)."""
        return [c for c in self.breaking if c.path in HANDSHAKE]

    @property
    def raised(self) -> bool:
        """This build's protocol version is above the release's: nothing is shared."""
        return self.protocol > self.release_protocol

    @property
    def ok(self) -> bool:
        return not self.handshake and (self.raised or not (self.breaking or self.unguarded))

    def message(self) -> str:
        """The verdict and every difference, one per line."""
        head = (f"proto/ringlet.proto against release {self.release} (wire protocol {self.release_protocol}); "
                f"this build speaks protocol {self.protocol}")
        lines = [head]
        if self.raised:
            lines.append(f"protocol {self.protocol} > {self.release_protocol}: nodes of the two are kept apart, "
                         "so the differences are allowed, except to the handshake")
        if self.handshake:
            lines.append("changes the handshake, which every protocol version must read the same (HANDSHAKE in "
                         "daemon/wire/compat.py): nodes could no longer tell each other's versions; undo it:")
            lines += [f"  {c.path}: {c.what}" for c in self.handshake]
        if [c for c in self.breaking if c.path not in HANDSHAKE]:
            lines.append("needs a new protocol version (raise PROTOCOL_VERSION in daemon/wire/versions.py) "
                         "or undo it:" if not self.raised else "incompatible with the release:")
            lines += [f"  {c.path}: {c.what}" for c in self.breaking if c.path not in HANDSHAKE]
        if self.unguarded:
            lines.append("added without a guard: an older node ignores it or refuses it; list it in ADDITIONS "
                         "(daemon/wire/compat.py) with the capability a node checks its peers for before "
                         "sending or relying on it, or 'informational: <why an older node may ignore it>'; "
                         "or raise PROTOCOL_VERSION:")
            for c in self.unguarded:
                bad = f" (ADDITIONS names {c.guard!r}, not a capability of this build)" if c.guard else ""
                lines.append(f"  {c.path}: {c.what}{bad}")
        guarded = [c for c in self.changes if c.guarded]
        if guarded:
            lines.append("added, guarded:")
            lines += [f"  {c.path}: {c.what} [{c.guard}]" for c in guarded]
        if not self.changes:
            lines.append("no differences")
        return "\n".join(lines)


# -- reading descriptors ------------------------------------------------------------------


def load_set(data: bytes) -> descriptor_pb2.FileDescriptorSet:
    """A serialized FileDescriptorSet (``protoc --descriptor_set_out``)."""
    out = descriptor_pb2.FileDescriptorSet()
    out.ParseFromString(data)
    return out


def released(directory: Path) -> list[tuple[str, Path, int]]:
    """``(release, descriptor file, protocol version)`` of every release kept in
    ``directory`` (``proto/released``), oldest first."""
    found = []
    for meta in directory.glob("*.json"):
        info = json.loads(meta.read_text())
        found.append((info["release"], meta.with_suffix(".binpb"), int(info["protocol_version"])))
    return sorted(found, key=lambda r: versions.release_key(r[0]))


@dataclass
class _Index:
    """A descriptor set's messages, enums and services by full name (no leading dot)."""

    syntax: dict[str, str] = field(default_factory=dict)
    messages: dict[str, descriptor_pb2.DescriptorProto] = field(default_factory=dict)
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = field(default_factory=dict)
    services: dict[str, descriptor_pb2.ServiceDescriptorProto] = field(default_factory=dict)


def _index(fds: descriptor_pb2.FileDescriptorSet) -> _Index:
    idx = _Index()

    def walk(prefix: str, messages, enums) -> None:
        for e in enums:
            idx.enums[f"{prefix}{e.name}"] = e
        for m in messages:
            name = f"{prefix}{m.name}"
            idx.messages[name] = m
            walk(f"{name}.", m.nested_type, m.enum_type)

    for f in fds.file:
        prefix = f"{f.package}." if f.package else ""
        idx.syntax[f.name] = f.syntax or "proto2"
        walk(prefix, f.message_type, f.enum_type)
        for s in f.service:
            idx.services[f"{prefix}{s.name}"] = s
    return idx


# -- comparing ----------------------------------------------------------------------------


def _field_shape(msg: descriptor_pb2.DescriptorProto, f: descriptor_pb2.FieldDescriptorProto) -> dict[str, str]:
    """What an older node's parser depends on, besides the number: type, label, presence, oneof."""
    kind = f.type_name.lstrip(".") if f.type_name else _TYPES[f.type]
    oneof = msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") and not f.proto3_optional else ""
    return {"type": kind, "label": _LABELS[f.label], "presence": "explicit" if f.proto3_optional else "implicit",
            "oneof": oneof or "(none)"}


def _compare_fields(name: str, old: descriptor_pb2.DescriptorProto, new: descriptor_pb2.DescriptorProto,
                    out: list[Change]) -> None:
    old_by_num = {f.number: f for f in old.field}
    new_by_num = {f.number: f for f in new.field}
    new_by_name = {f.name: f for f in new.field}
    old_names = {f.name for f in old.field}
    for num, f in old_by_num.items():
        path = f"{name}.{f.name}"
        g = new_by_num.get(num)
        if g is None:
            moved = new_by_name.get(f.name)
            out.append(Change(path, f"renumbered from {num} to {moved.number}" if moved else f"field {num} removed",
                              breaking=True))
            continue
        if g.name != f.name:
            out.append(Change(path, f"field {num} renamed to {g.name!r} (a new meaning needs a new number)",
                              breaking=True))
        was, now = _field_shape(old, f), _field_shape(new, g)
        for key in was:
            if was[key] != now[key]:
                out.append(Change(path, f"{key} changed from {was[key]} to {now[key]}", breaking=True))
    for num, g in new_by_num.items():
        if num not in old_by_num and g.name not in old_names:
            shape = _field_shape(new, g)
            where = f" in oneof {shape['oneof']}" if shape["oneof"] != "(none)" else ""
            out.append(Change(f"{name}.{g.name}", f"field {num} ({shape['label']} {shape['type']}){where} added",
                              breaking=False))


def _compare_enums(old: _Index, new: _Index, out: list[Change]) -> None:
    for name, e in old.enums.items():
        g = new.enums.get(name)
        if g is None:
            out.append(Change(name, "enum removed", breaking=True))
            continue
        now = {v.number: v.name for v in g.value}
        was = {v.number: v.name for v in e.value}
        for num, vname in was.items():
            if now.get(num) != vname:
                what = f"value {vname} = {num} " + (f"renamed to {now[num]}" if num in now else "removed")
                out.append(Change(f"{name}.{vname}", what, breaking=True))
        for num, vname in now.items():
            if num not in was:
                out.append(Change(f"{name}.{vname}", f"value {num} added", breaking=False))
    for name in new.enums.keys() - old.enums.keys():
        if name.rsplit(".", 1)[0] not in new.messages.keys() - old.messages.keys():
            out.append(Change(name, "enum added", breaking=False))


def _compare_services(old: _Index, new: _Index, out: list[Change]) -> None:
    def sig(m: descriptor_pb2.MethodDescriptorProto) -> str:
        stream = ("stream " if m.client_streaming else "", "stream " if m.server_streaming else "")
        return f"({stream[0]}{m.input_type.lstrip('.')}) returns ({stream[1]}{m.output_type.lstrip('.')})"

    for name, s in old.services.items():
        t = new.services.get(name)
        if t is None:
            out.append(Change(name, "service removed", breaking=True))
            continue
        now = {m.name: m for m in t.method}
        for m in s.method:
            if m.name not in now:
                out.append(Change(f"{name}.{m.name}", "method removed", breaking=True))
            elif sig(m) != sig(now[m.name]):
                out.append(Change(f"{name}.{m.name}", f"changed from {sig(m)} to {sig(now[m.name])}", breaking=True))
        was = {m.name for m in s.method}
        out += [Change(f"{name}.{m.name}", f"method {sig(m)} added", breaking=False) for m in t.method
                if m.name not in was]
    out += [Change(name, "service added", breaking=False) for name in new.services.keys() - old.services.keys()]


def compare(old_set: descriptor_pb2.FileDescriptorSet, new_set: descriptor_pb2.FileDescriptorSet) -> list[Change]:
    """Every difference from ``old_set`` to ``new_set``, unclassified by :data:`ADDITIONS`."""
    old, new = _index(old_set), _index(new_set)
    out: list[Change] = []
    for fname, syntax in old.syntax.items():
        if fname in new.syntax and new.syntax[fname] != syntax:
            out.append(Change(fname, f"syntax changed from {syntax} to {new.syntax[fname]}", breaking=True))
    added_messages = new.messages.keys() - old.messages.keys()
    for name, msg in old.messages.items():
        if name not in new.messages:
            out.append(Change(name, "message removed", breaking=True))
        else:
            _compare_fields(name, msg, new.messages[name], out)
    for name in sorted(added_messages):
        if name.rsplit(".", 1)[0] not in added_messages:  # a message nested in an added one comes with it
            out.append(Change(name, "message added", breaking=False))
    _compare_enums(old, new, out)
    _compare_services(old, new, out)
    return out


def check(old_set: descriptor_pb2.FileDescriptorSet, new_set: descriptor_pb2.FileDescriptorSet, *,
          release: str, release_protocol: int, protocol: int = versions.PROTOCOL_VERSION,
          additions: dict[str, str] | None = None) -> Report:
    """Compare ``new_set`` (this build's wire) with ``old_set`` (release ``release``, whose
    protocol version was ``release_protocol``) and classify each addition by
    ``additions`` (default :data:`ADDITIONS`)."""
    listed = ADDITIONS if additions is None else additions
    changes = [c if c.breaking else Change(c.path, c.what, False, listed.get(c.path))
               for c in compare(old_set, new_set)]
    return Report(release, release_protocol, protocol, changes)
