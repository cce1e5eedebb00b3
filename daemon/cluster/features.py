"""The optional wire features a plan uses, and the members a model may be planned on, by
what each member speaks (:mod:`ringlet.daemon.wire.versions`).

A plan uses a capability only where every node taking part in it speaks it: its stages,
a tensor plan's ranks, a hybrid plan's groups. The proposer computes that set once, as
the intersection of those members' records (:func:`plan_features`), and carries it in the
proposal's plan JSON under ``"features"`` (:func:`plan_body`); every member serves the
committed plan with exactly that set (:func:`features_of`), so stage 0's drafts, the
stages' verifying and trimming and the KV moved at a re-plan agree on every stage. A
node of release 0.1.0 reads the plan JSON with ``Plan.from_dict``, which ignores the key;
a proposal without it comes from such a node, whose plan speaks the baseline alone.

Some models need a feature to be run at all (a hop's second residual stream, RWKV-7's
``v_first``): they are planned only on members that speak it (:func:`required_by`,
:func:`unable`); the others are left out with a reason naming the node to upgrade.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

from ringlet.daemon.engine.streams import STREAMS
from ringlet.daemon.wire import versions
from ringlet.partitioning import Plan

#: The plan JSON's key for the features the committed plan uses (sorted capability names).
FEATURES_KEY = "features"

#: What each capability is, in the words of a reason for a node that lacks it.
WHAT = {versions.SECOND_STREAM: "a hop's second residual stream", versions.DRAFTS: "drafts",
        versions.KV_KINDS: "KV pieces of every cache kind", versions.TENSOR_TRIMS: "tensor-group trims",
        versions.PREFILL_PROGRESS: "prefill progress events", versions.RECONCILE: "reconciling views"}


def taking_part(plan: Plan | None, mode: Mapping | None = None) -> list[str]:
    """The node ids that take part in ``plan`` under the mode decision ``mode``: its stages,
    and a tensor or hybrid plan's ranks (every node of every group)."""
    ids = [s.node_id for s in plan.stages] if plan is not None else []
    if mode and mode.get("mode") in ("tensor", "hybrid"):
        ids += [str(r) for r in mode.get("ranks") or ()]
        ids += [str(r) for g in mode.get("groups") or () for r in g]
    return sorted(set(ids))


def plan_features(records: Mapping[str, Mapping | None], plan: Plan | None,
                  mode: Mapping | None = None) -> frozenset[str]:
    """The capabilities every node taking part in ``plan`` speaks (``records``: member
    records by node id; a missing or version-less record is a node of release 0.1.0, the
    baseline). Empty for no plan."""
    ids = taking_part(plan, mode)
    if not ids:
        return frozenset()
    return versions.common(records.get(i) for i in ids)


def members_speak(cluster, feature: str, node_ids: Iterable[str] | None = None) -> bool:
    """Whether the members ``node_ids`` (default: every alive member) of ``cluster`` (a
    :class:`.negotiation.Negotiator`) speak ``feature`` by their records; an empty id is a
    caller that did not say (the baseline). With no cluster (a static ``--plan``), this
    build's nodes are assumed: ``True``."""
    if cluster is None:
        return True
    membership = cluster.membership
    ids = membership.alive_ids() if node_ids is None else node_ids
    return feature in versions.common(membership.record_of(i) if i else None for i in ids)


def plan_body(plan: Plan, features: Iterable[str]) -> str:
    """The proposal's plan JSON: ``plan.to_dict()`` with the features it uses."""
    return json.dumps({**plan.to_dict(), FEATURES_KEY: sorted(features)}, sort_keys=True)


def features_of(body: Mapping) -> frozenset[str]:
    """The features a proposal's plan JSON (a dict) says its plan uses: none when it says
    nothing (a proposer of release 0.1.0) or names something else than a list of strings;
    names this build does not know are dropped."""
    names = body.get(FEATURES_KEY)
    if not isinstance(names, list):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str)) & versions.CAPABILITIES


def required_by(config: Mapping | None) -> frozenset[str]:
    """The capabilities a node needs to hold any stage of the model of ``config`` (its
    ``config.json`` as a dict): a second residual stream for the architectures whose hops
    carry one (:data:`ringlet.daemon.engine.streams.STREAMS`)."""
    model_type = (config or {}).get("model_type")
    return frozenset({versions.SECOND_STREAM}) if model_type in STREAMS else frozenset()


def split_refusal(record_of: Callable[[str], Mapping | None], stage_ids: list[str], required: frozenset[str],
                  model: str) -> str | None:
    """Why a member refuses a plan that splits ``model`` (more than one stage) over a node
    lacking one of ``required`` (an older proposer does not know the rule); ``None``: it
    may serve it. ``record_of`` gives a member's record by node id."""
    if len(stage_ids) < 2 or not required:
        return None
    out = unable({i: record_of(i) for i in stage_ids}, required, model)
    return "; ".join(out[i] for i in sorted(out)) or None


def unable(records: Mapping[str, Mapping | None], required: frozenset[str], model: str) -> dict[str, str]:
    """The members of ``records`` that lack one of ``required`` for ``model``, each with the
    reason it is left out (naming the release it runs and that it is to be upgraded)."""
    out = {}
    for node_id, record in records.items():
        missing = sorted(required - versions.capabilities_of(record))
        if missing:
            what = ", ".join(WHAT.get(m, m) for m in missing)
            out[node_id] = (f"{node_id} runs ringlet {versions.release_of(record)}, which lacks {what} that {model} "
                            f"needs: upgrade {node_id} to ringlet {versions.RELEASE} or newer")
    return out
