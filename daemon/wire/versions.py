"""What this build is and what it speaks on the wire: release, protocol version, capabilities.

Three figures tell two nodes whether and how they can work together (docs/wire-compat.md):

- :data:`RELEASE`: this build's release (semantic versioning, ``pyproject.toml``'s
  ``version``), for people: ``ringlet --version``, status, the dashboard, ``/v1/cluster``.
  Two releases never decide anything by themselves.
- :data:`PROTOCOL_VERSION`: the wire protocol. Nodes of different protocol versions never
  form one cluster: the newer one keeps the older out with a reason naming both versions
  (:func:`incompatible_reason`). Raised only when a change cannot be made optional.
- :data:`CAPABILITIES`: the optional features this build speaks beyond the protocol
  version's baseline (the wire of release 0.1.0). A plan uses a feature only where every
  node taking part has it (:func:`common`); a member that names none (a 0.1.0 node, whose
  record has no ``capabilities``) speaks the baseline alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import metadata

#: The wire protocol this build speaks. Nodes of another protocol version are kept out.
PROTOCOL_VERSION: int = 1

#: Capability names, each one feature beyond the protocol's baseline (release 0.1.0).
#: Speculative decoding: ``Activation.drafts`` (the last stage verifies, every stage
#: trims), ``Activation.tokens``/``token_scores`` (several tokens per step) and
#: ``GenerateRequest.prediction``.
DRAFTS = "drafts"
#: ``GenerateEvent.progress``: stage 0 streams prefill progress to the API node.
PREFILL_PROGRESS = "prefill_progress"
#: A hop's second residual stream (RWKV-7's ``v_first``, Talkie's normalized embedding).
SECOND_STREAM = "second_stream"
#: KV pieces of every mlx-lm cache kind (windows, recurrent states, 0-wide length caches).
KV_KINDS = "kv_kinds"
#: Tensor groups whose ranks trim (``OP_TRIM``): drafts in tensor and hybrid plans.
TENSOR_TRIMS = "tensor_trims"
#: ``Heartbeat.membership_digest`` and ``Vote.members``: refused proposals reconcile views.
RECONCILE = "reconcile"

#: Everything this build speaks.
CAPABILITIES: frozenset[str] = frozenset({DRAFTS, PREFILL_PROGRESS, SECOND_STREAM, KV_KINDS, TENSOR_TRIMS,
                                          RECONCILE})

#: The record keys that carry a member's versions.
RECORD_RELEASE, RECORD_PROTOCOL, RECORD_CAPABILITIES = "release", "protocol_version", "capabilities"


def _release() -> str:
    try:
        return metadata.version("ringlet")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


#: This build's release, e.g. ``"0.2.0"``.
RELEASE: str = _release()


def release_key(release: str) -> tuple[int, ...]:
    """A sortable key of a release string: its leading numbers (``0.10.0`` after ``0.9.1``;
    a part without digits sorts first)."""
    numbers = []
    for part in release.split("."):
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else -1)
    return tuple(numbers)


def record_fields() -> dict:
    """The version fields of this node's member record (JSON-safe): release, protocol
    version, capabilities (sorted list of names)."""
    return {RECORD_RELEASE: RELEASE, RECORD_PROTOCOL: PROTOCOL_VERSION, RECORD_CAPABILITIES: sorted(CAPABILITIES)}


def capabilities_of(record: Mapping | None) -> frozenset[str]:
    """The capabilities a member's record names; none for a record without the field (a
    node of release 0.1.0, which speaks the baseline alone) or for no record."""
    names = (record or {}).get(RECORD_CAPABILITIES) or ()
    return frozenset(n for n in names if isinstance(n, str))


def release_of(record: Mapping | None) -> str:
    """A member's release as its record says, or ``"0.1.0"`` for a record without one (the
    last release before records carried it)."""
    value = (record or {}).get(RECORD_RELEASE)
    return value if isinstance(value, str) and value else "0.1.0"


def member_versions(record: Mapping | None) -> dict:
    """A member's ``release``, ``protocol_version`` and ``capabilities`` (sorted names) as its
    record gives them, for ``/v1/cluster``: a record without them is a node of release 0.1.0,
    which speaks protocol 1's baseline."""
    record = record or {}
    protocol = record.get(RECORD_PROTOCOL)
    return {"release": release_of(record), "protocol_version": protocol if isinstance(protocol, int) else 1,
            "capabilities": sorted(capabilities_of(record))}


def common(records: Iterable[Mapping | None]) -> frozenset[str]:
    """The capabilities every one of ``records`` names (this build's own set for none)."""
    out = CAPABILITIES
    for record in records:
        out = out & capabilities_of(record)
    return out


def incompatible_reason(node_id: str, release: str, protocol: int) -> str:
    """Why a node of another protocol version is kept out, naming both versions and which
    node to upgrade."""
    if protocol < PROTOCOL_VERSION:
        fix = f"upgrade {node_id} to ringlet {RELEASE} or newer"
    else:
        fix = f"upgrade this node (ringlet {RELEASE}) to {release} or newer, or keep {node_id} on an older release"
    return (f"{node_id} runs ringlet {release} with wire protocol {protocol}; this node runs {RELEASE} with "
            f"protocol {PROTOCOL_VERSION}: they cannot share a ring ({fix})")
