"""``ringlet doctor``: check this machine for running a ringlet node, and say how to fix it.

Checks, in order (each prints ``OK``, ``WARN`` or ``FAIL``, and a ``fix:`` line
when there is something to do):

- **mlx device**: MLX imports and computes; on macOS the GPU (Metal) is there.
- **model**: the model resolves (:func:`ringlet.daemon.engine.sources.resolve`), with
  its depth and size.
- **memory**: total and usable memory (:func:`ringlet.daemon.probes.memory.probe_memory`)
  against the model's size.
- **gpu wired limit** (macOS): ``iogpu.wired_limit_mb`` and the advice to raise it
  for big models.
- **disk space**: free space where the data dir (node id, model cache) lives.
- **multicast**: the chosen interfaces are up, multicast-capable and addressed;
  the mDNS port can be bound. Nothing is sent on any interface.
- **ports**: the gRPC and API ports are free (or held by a ringlet daemon).
- **firewall**: macOS application firewall (``socketfilterfw``); ``ufw`` on Linux.
- **thunderbolt**: macOS: Thunderbolt links and the Thunderbolt Bridge loop
  (:func:`ringlet.daemon.probes.bridge_loop_warning`); Linux: XDomain peers.
- **secret**: the cluster secret file, if any, loads and is private.
- **service**: is ringlet installed as a service, and (Linux) lingering.
- **daemon**: does a daemon answer on the API port.

Options default to the service configuration (``ringlet service install``) when
there is one. A check that does not apply to this OS prints ``OK`` with
"skipped". A check that itself breaks prints ``WARN`` ("could not check"):
doctor never ends in a traceback. Exit status: 1 when any check FAILs, else 0
(2 for bad input).

Modules: :mod:`~ringlet.daemon.ops.doctor.base` (a check's result and context),
:mod:`~ringlet.daemon.ops.doctor.machine` (MLX, model, memory, wired limit, disk),
:mod:`~ringlet.daemon.ops.doctor.network` (multicast, ports, firewall, Thunderbolt,
daemon), :mod:`~ringlet.daemon.ops.doctor.config` (secret, service) and
:mod:`~ringlet.daemon.ops.doctor.command` (the order of the checks, the options, the report).
"""
