"""The supervisor's records of a tensor group's epoch: one :class:`Epoch` (one start of the
group's rank processes) and a :class:`RankState` per rank, which the epoch state machine
(:mod:`ringlet.daemon.tensor.group_epochs`) updates from the ranks' control messages."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from ringlet.daemon.tensor.launch import RankHandle
from ringlet.daemon.tensor.planning.decision import TPDecision
from ringlet.daemon.tensor.planning.mlx_hosts import HostConfig


@dataclass
class RankState:
    """What the supervisor knows of one rank of an epoch."""

    rank: int
    node_id: str
    handle: RankHandle | None = None
    writer: asyncio.StreamWriter | None = None
    last_hb: float = 0.0
    step: int = 0
    busy_for: float = 0.0
    phase: str = "starting"
    loaded: bool = False
    ready: bool = False
    trims: bool = False  # its KV caches drop drafted positions exactly (speculative decoding)
    exit_code: int | None = None
    gave_up: bool = False  # sent "fatal" and exits on its own
    side_port: int | None = None  # rank 0: where the others connect their side channel
    fatal: str = ""
    fatal_phase: str = ""
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # its control connection is closed and drained


@dataclass
class Epoch:
    """One start of the group: its decision, ranks, MLX host configuration and fate."""

    number: int
    decision: TPDecision
    size: int
    backend: str
    token: str
    directory: Path
    ranks: list[RankState]
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    all_loaded: asyncio.Event = field(default_factory=asyncio.Event)
    all_ready: asyncio.Event = field(default_factory=asyncio.Event)
    lost: set[str] = field(default_factory=set)
    why: str = ""
    started_at: float = field(default_factory=time.monotonic)
    tasks: list[asyncio.Task] = field(default_factory=list)
    torn: bool = False  # being torn down: exits and EOFs from now on are ours
    launching: list = field(default_factory=list)  # (rank state, launcher task)
    host_config: HostConfig | None = None
