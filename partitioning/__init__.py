"""ringlet.partitioning -- the ring planner (pure: no I/O, no asyncio, no MLX).

Given the nodes, their links and a model, decide the order of the nodes around
the pipeline ring and the contiguous layer range each one holds.

Public API
==========

Inputs (frozen dataclasses, validated on construction; bad numbers raise
``ValueError`` naming the field):

* ``NodeSpec(node_id, memory_bytes, bandwidth_bytes_per_s, flops)``
* ``LinkSpec(a, b, bandwidth_bytes_per_s, latency_s, kind="direct")``
* ``ModelSpec(layer_bytes, embedding_bytes, head_bytes, kv_bytes_per_token_per_layer,
  context_tokens, flops_per_token_per_layer, name="model", layer_read_bytes=None,
  tie_word_embeddings=False, head_flops_per_token=0.0, activation_bytes_per_token=0,
  kv_window_tokens=None)`` -- layer-wise fields take a number or one value per layer.
* ``Policy(name="balanced"|"memory"|"latency", tolerance=0.01,
  fallback_bandwidth_bytes_per_s=125e6, fallback_latency_s=1e-3, token_bytes=16,
  exact_ring_max_nodes=10, max_candidate_orders=16, max_insertion_orders=720,
  ring_order=None)``

Planning:

* ``make_plan(nodes, links, model, previous=None, policy=None) -> Plan``
  raises ``Infeasible`` (a ``ValueError`` with ``shortfall_bytes``,
  ``max_context_tokens``, ``required_bytes``, ``available_bytes``, ``message``)
  when the model does not fit, ``ValueError`` for duplicate ids, ``TypeError``
  for wrong argument types. Nodes that cannot serve are left out with a reason.
* ``validate_plan(plan, num_layers, node_ids=None)`` raises ``InvalidPlan``
  (a ``ValueError``) unless every layer is served exactly once, in contiguous
  non-empty ranges following the ring order, and the ``plan_id`` matches.

Several models in pooled memory (``placement``):

* ``place_models(nodes, links, models, *, previous=None, policy=None,
  per_model_overhead_bytes=0) -> Placement``: the models in priority order, each
  planned by ``make_plan`` on the memory the ones before it leave; a model that does
  not fit is left out with the reason (never for a lower-priority one).
  ``Placement`` (frozen): ``priority``, ``plans`` (name -> ``Plan``), ``left_out``
  (name -> reason), ``memory_bytes``, ``memory_left`` (node id -> bytes),
  ``overhead_bytes``; ``to_dict()``/``from_dict()``.

Output:

* ``Plan`` (frozen): ``ring_order``, ``stages`` (``Stage(node_id, start, end,
  time_s, memory_bytes, capacity_bytes, load_bytes, embeds, heads)``, half-open
  ranges), ``hops`` (``Hop``: forward hops then the routed return),
  ``excluded`` (``ExcludedNode(node_id, code, reason)``), ``latency_s``,
  ``throughput_tokens_per_s``, ``max_stage_time_s``, ``load_bytes``, ``notes``,
  ``plan_id`` (stable hash of model, context and assignment);
  ``to_dict()``/``from_dict()`` and ``to_json()``/``from_json()`` round-trip.

Units everywhere: bytes, seconds, bytes/s, FLOP/s.

Algorithms (details in each module):

* cost model (``costs``): stage time = bytes read / bandwidth + FLOPs / compute,
  memory = weights + KV cache at the target context (+ embedding / head);
* ring order (``ring``): maximise the slowest forward link, then minimise the
  ring's total time (forward hops + the routed return), then by node id; exact
  (threshold search + Held-Karp, O(2^n n^2)) up to 10 nodes, networkx
  ``greedy_tsp`` + 2-opt beyond;
* splits (``split``): exact dynamic programmes over ``(L+1) x (L+1)`` cost
  matrices: min-max O(k L^2), lexicographic additive O(k L^2), with hop costs
  O(k |F| L^2 + k^2 |F| L); exo's largest-remainder proportional split;
* policies (``policies``): balanced / memory / latency;
* re-sharding stability (``stability``): with a previous plan, keep the old ring
  (new nodes inserted anywhere) and, among plans within ``tolerance`` of the best,
  load the fewest bytes.
"""

from .errors import Infeasible, InvalidPlan
from .placement import Placement, place_models
from .plan import ExcludedNode, Hop, Plan, Stage
from .planner import make_plan
from .spec import POLICY_NAMES, LinkSpec, ModelSpec, NodeSpec, Policy
from .validate import validate_plan

__all__ = [
    "POLICY_NAMES",
    "ExcludedNode",
    "Hop",
    "Infeasible",
    "InvalidPlan",
    "LinkSpec",
    "ModelSpec",
    "NodeSpec",
    "Placement",
    "Plan",
    "Policy",
    "Stage",
    "make_plan",
    "place_models",
    "validate_plan",
]
