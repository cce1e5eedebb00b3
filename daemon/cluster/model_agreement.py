"""Which model the cluster serves when its members hold different ones.

Every member's record carries its model (``"model"``: ``ORG/NAME@COMMIT`` for a Hub
model — the resolved commit, not the branch — else the model's name). The cluster
serves the model most members hold; a tie goes to the model of the member with the
lowest id. Every member computes the same answer from the same records. The members
holding it are the ones plans are made for (the proposer is the lowest id among them);
any other member is kept out of the plan and told so by name, in the event logs of
both sides and in ``/v1/cluster`` (``negotiation.kept_out``); its API answers 503
with the reason until it runs the same model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Agreement:
    """The outcome for one view: ``model`` the cluster serves, ``eligible`` the ids (sorted)
    of the members holding it, ``kept_out`` ``{id: model}`` of the others."""

    model: str
    eligible: list[str]
    kept_out: dict[str, str] = field(default_factory=dict)


def agree(ids: list[str], model_of: Callable[[str], str | None], default: str) -> Agreement:
    """The model most of ``ids`` hold (``model_of(id)``; ``None``, a record not known yet,
    counts as ``default``); a tie goes to the lowest id's."""
    models = {i: model_of(i) or default for i in sorted(ids)}
    counts = Counter(models.values())
    first = {}
    for i, m in models.items():
        first.setdefault(m, i)
    model = min(counts, key=lambda m: (-counts[m], first[m]))
    return Agreement(model, [i for i, m in models.items() if m == model],
                     {i: m for i, m in models.items() if m != model})


def _revision_of(model: str) -> str:
    return model.partition("@")[2][:12] or model


class ModelAgreement:
    """One node's view of :func:`agree` over its membership, and the events it says once
    per change.

    Args:
        own_model: this node's model (``ModelLocation.ident``).
        event: ``event(kind, message)`` of the node.
    """

    def __init__(self, own_model: str, event: Callable[[str, str], None]):
        self.own_model = own_model
        self.event = event
        self.kept_out_reason: str | None = None  # why this node is kept out (None: it is not)
        self._said: dict[str, str] = {}

    def view(self, membership) -> Agreement:
        """The agreement over ``membership``'s alive members (records as they are)."""
        ids = membership.alive_ids()
        own = membership.node_id

        def model_of(i: str) -> str | None:
            return self.own_model if i == own else (membership.record_of(i) or {}).get("model")

        return agree(ids, model_of, self.own_model)

    def info(self, membership) -> dict:
        """For ``/v1/cluster``'s ``negotiation``: the ``proposer`` (lowest id holding the
        cluster's model), ``is_proposer`` (this node is it), ``kept_out`` ``{id: model}`` and
        this node's ``kept_out_reason``."""
        a = self.view(membership)
        return {"proposer": a.eligible[0], "is_proposer": a.eligible[0] == membership.node_id,
                "kept_out": a.kept_out, "kept_out_reason": self.kept_out_reason}

    def report(self, membership) -> Agreement:
        """:meth:`view`, recording an event for each member newly kept out (and, on a node
        kept out, why and what to run instead)."""
        a = self.view(membership)
        me = membership.node_id
        for node_id, model in a.kept_out.items():
            if self._said.get(node_id) == model:
                continue
            name = (membership.record_of(node_id) or {}).get("name") or ""
            if node_id == me:
                holders = ", ".join(i[:8] for i in a.eligible)
                self.kept_out_reason = (f"this node serves {model}, the cluster {a.model} ({len(a.eligible)} of "
                                        f"{len(a.eligible) + len(a.kept_out)} members: {holders}); kept out of "
                                        f"the plan: restart it with --model {a.model}")
                self.event("kept-out", self.kept_out_reason)
            else:
                self.event("kept-out", f"{node_id[:8]}{f' ({name})' if name else ''} serves {model}, not the "
                                       f"cluster's {a.model}: revision {_revision_of(model)} is not "
                                       f"{_revision_of(a.model)}; kept out of the plan")
        if me not in a.kept_out:
            self.kept_out_reason = None
        self._said = dict(a.kept_out)
        return a
