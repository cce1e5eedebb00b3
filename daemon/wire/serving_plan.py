"""The committed plan as every member holds it: epoch, stages in ring order, mode.

A :class:`ServingPlan` is what negotiation commits (``cluster``), what the node
serves (``node``) and what tensor groups start from (``tensor``); it lives here, below
all three, so none of them reaches into another for it. Built from the wire's
``Proposal`` / ``CommitRequest`` (``proto/ringlet.proto``) or from a static ``--plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringlet.daemon.wire import versions


@dataclass(frozen=True)
class StageSpec:
    """One stage: the node's gRPC address (``host:port``) and its layer range ``[start, end)``.

    ``address`` is where every member can dial the node (stage 0 takes every member's
    requests); ``hop_address``, when set, is where the stage before it dials it instead (its
    measured fastest route to this neighbour, e.g. over a Thunderbolt cable): see
    :attr:`dial_from_previous`.

    In a plan's ``previous`` stages, ``rebuild`` says that this range's KV is rebuilt by
    its new holders from the boundary activations entering ``start`` instead of being
    fetched from this node (it is lost, or recomputing is predicted faster), and ``why``.
    """

    address: str
    start: int
    end: int
    node_id: str = ""
    rebuild: bool = False
    why: str = ""
    lost: bool = False
    hop_address: str = ""

    @property
    def dial_from_previous(self) -> str:
        """The address the previous stage's hop stream dials: ``hop_address``, else ``address``."""
        return self.hop_address or self.address


@dataclass(frozen=True)
class ServingPlan:
    """A committed plan as the serving path needs it.

    Attributes:
        epoch: plan epoch (strictly increasing across commits).
        stages: ring order; each with node id, gRPC address and layer range.
        plan_id: the planner's stable id (or a digest for static plans).
        infeasible: when set, no plan can serve the model; the reason for users.
        detail: the planner's plan as a dict (``Plan.to_dict()``), if any.
        tp: the mode decision (:mod:`ringlet.daemon.tensor.serving`), if any. When its
            ``mode`` is ``tensor``, ``stages`` are the ranks in rank order (each holds
            every layer, in its rank process) and stage 0 (rank 0) drives the group.
            When it is ``hybrid``, ``stages`` are the tensor groups' leaders with the
            groups' layer ranges (a pipeline whose stages run in their groups' rank
            processes, :mod:`ringlet.daemon.tensor.group_stage`).
        previous: the stages of the plan this one replaces, as its proposer served it
            (empty: unknown, or the first plan): where a node that gains layers fetches
            their KV caches from.
        features: the optional wire features (:mod:`.versions` capability names) every
            node taking part speaks, which the plan may use (:meth:`uses`); computed once
            by the proposer. ``None``: not negotiated (a static ``--plan``, whose nodes
            are taken to run this build).
    """

    epoch: int
    stages: tuple[StageSpec, ...]
    plan_id: str
    infeasible: str | None = None
    detail: dict | None = None
    tp: dict | None = None
    previous: tuple[StageSpec, ...] = ()
    features: frozenset[str] | None = None

    def uses(self, feature: str) -> bool:
        """Whether this plan may use ``feature`` (a :mod:`.versions` capability name):
        every node taking part speaks it."""
        return feature in (self.features if self.features is not None else versions.CAPABILITIES)

    @property
    def drafts(self) -> bool:
        """Whether its head may draft (speculative decoding): every node taking part
        verifies and trims drafted positions (:data:`.versions.DRAFTS`), and, in a tensor
        or hybrid plan, has its group's ranks trim (:data:`.versions.TENSOR_TRIMS`)."""
        return self.uses(versions.DRAFTS) and (not self.tp or self.tp.get("mode") not in ("tensor", "hybrid")
                                               or self.uses(versions.TENSOR_TRIMS))

    @property
    def is_tensor(self) -> bool:
        return bool(self.tp) and self.tp.get("mode") == "tensor"

    @property
    def is_hybrid(self) -> bool:
        return bool(self.tp) and self.tp.get("mode") == "hybrid"

    def index_of(self, node_id: str, address: str) -> int | None:
        for i, s in enumerate(self.stages):
            if (s.node_id and s.node_id == node_id) or (not s.node_id and s.address == address):
                return i
        return None
