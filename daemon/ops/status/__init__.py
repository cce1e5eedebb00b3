"""``ringlet status``: one snapshot of the cluster, as seen through nodes' ``GET /v1/cluster``.

The snapshot is the data the dashboard draws (:mod:`ringlet.daemon.ops.dashboard`) and
what ``ringlet status --json`` prints for scripts. It is built in two steps:

1. **fetch** (:class:`~ringlet.daemon.ops.status.collector.Collector`): ``GET /v1/cluster``
   from every API URL known -- the ``--api`` URLs given (the first one that answers is
   the *primary*) and every ``members[].api_url`` a node reported -- concurrently, each
   with a short timeout. A node that does not answer is marked unreachable; nothing raises.
2. **normalise** (:func:`~ringlet.daemon.ops.status.snapshot.build_snapshot`, pure): merge
   the answers into one JSON-safe dict, in ring (plan) order. Every field of
   ``/v1/cluster`` is optional: what a node does not report is ``None`` and drawn as "—".

Modules: :mod:`~ringlet.daemon.ops.status.urls` (which API URLs to ask),
:mod:`~ringlet.daemon.ops.status.values` (reading reported values),
:mod:`~ringlet.daemon.ops.status.snapshot` (normalise; the snapshot schema),
:mod:`~ringlet.daemon.ops.status.model_rings` (a node serving several models: each one's ring),
:mod:`~ringlet.daemon.ops.status.collector` (fetch) and
:mod:`~ringlet.daemon.ops.status.command` (the text and exit status of ``ringlet status``).
"""
