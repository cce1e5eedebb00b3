"""``ringlet dashboard``: a live terminal view of the cluster (rich).

It draws snapshots (:mod:`ringlet.daemon.ops.status.snapshot`): a header, the ring
of stages, the cluster's memory and last requests, and an event log. Anything a
daemon does not report is drawn as "—". The live loop polls at 2 Hz and redraws in
place (``rich.live.Live`` with ``auto_refresh=False``; no clearing, hence no flicker).

Modules: :mod:`~ringlet.daemon.ops.dashboard.widgets` (bars, states, hops),
:mod:`~ringlet.daemon.ops.dashboard.frame` (one frame, laid out for its width; pure),
:mod:`~ringlet.daemon.ops.dashboard.model_panel` (a line per model when a node serves several),
:mod:`~ringlet.daemon.ops.dashboard.events` (what changed between snapshots) and
:mod:`~ringlet.daemon.ops.dashboard.live` (the live loop and ``ringlet dashboard``).
"""
