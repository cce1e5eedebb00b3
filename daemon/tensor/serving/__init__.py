"""Tensor-parallel serving inside the daemon: the mode decision of a negotiated plan, the
group of a committed tensor plan, and the ranks this node runs for another leader.

* :mod:`.mode`: the mode decision over membership records (:func:`~.mode.decide_mode`),
  reading it (:func:`~.mode.group_of`) and checking a proposal's (:func:`~.mode.check_tp_dict`);
* :mod:`.thunderbolt`: the Thunderbolt ports a node publishes in its membership record;
* :mod:`.ranks`: rank processes on this machine (command line, environment, spawning) and
  what a leader may set for a rank;
* :mod:`.cluster_group`: the leader's group across the members' daemons (ranks started
  through ``RunRank``, remote rank handles, restarts on the same members);
* :mod:`.core`: :class:`~.core.TPServing`, the tensor-parallel part of one daemon.

How a tensor plan is served
---------------------------
* **Decision** (proposer, :func:`~.mode.decide_mode`):
  :func:`~ringlet.daemon.tensor.planning.decision.decide` over the members (memory and
  addresses from their records) and one link per pair (the measured link's kind and
  bandwidth when there is one; every pair of members reaches each other, since they
  heartbeat each other). The decision travels in the proposal (``Proposal.tp_json``)
  and becomes ``ServingPlan.tp``; a tensor plan lists the ranks as its stages, each
  holding every layer.
* **Modes.** ``auto`` keeps the pipeline when members share a machine (loopback links:
  their ranks would split one memory bus and gain nothing). ``--mode tensor`` (or
  ``hybrid``) runs that mode whenever the members can; when they cannot (heads do not
  divide by the group size, no ring, fewer than 4 members for hybrid), the cluster
  serves the pipeline, and ``/v1/cluster`` says the mode was refused and why
  (``tp.refused``): the pipeline stays the fallback, so losing a member of a tensor
  group keeps the cluster serving.
* **Hybrid** (tensor groups chained as pipeline stages): the decision lists the groups
  (``groups``, each in rank order, its leader first) and each group's layer range
  (``layer_ranges``: an even split, :func:`~.mode.hybrid_layer_ranges`). The plan's
  stages are the group leaders with those ranges; each leader's engine runs a
  :class:`~ringlet.daemon.tensor.group_stage.GroupStage` whose group (ranks started as for a
  tensor plan, but loading only the group's layers) computes the stage, and hidden
  states travel between leaders over the ordinary gRPC ring.
* **Group** (leader = rank 0 = the proposer, :class:`~.core.TPServing`): on commit it
  starts a :class:`~ringlet.daemon.tensor.group.TPGroup` whose
  :class:`~.cluster_group.ClusterLauncher` starts its own rank here and every other rank
  through that member's daemon (``RunRank``), so each rank runs on its own member's
  machine. The control server binds this node's cluster address and takes only
  connections that present the group epoch's random token.
* **Ranks for another leader** (:meth:`~.core.TPServing.run_rank`): only for the committed
  tensor plan naming this node at that rank, led by a member, with the control address
  on the leader's host; only MLX's own variables and host files are accepted. The rank
  lives as long as the call: cancelling it (or the leader vanishing) kills the rank, and
  a rank exits by itself when this daemon dies (its stdin closes).
* **Failure**: the group restarts on the same ranks when every member still answers
  (a rank process crashed; in-flight requests resume inside the group), up to
  ``max_restarts`` times in a row. A member that does not answer fails the group at
  once (it never shrinks by itself): in-flight requests get an error, the API node
  waits for the cluster's re-plan and resumes them on it by re-prefilling (Node.generate).
  A group that gives up (restarts exhausted, or it never started) makes its leader, the
  proposer, re-plan the same members on the pipeline, saying why; a membership change
  tries tensor again.
"""
