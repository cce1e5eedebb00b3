"""``ringlet run``: one daemon process — the node, its gRPC server and its HTTP API."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from .api import create_app
from .memory_tuning import tune_allocator
from .model_info import load_tokenizer, model_info
from .node import Node, NodeConfig
from .sources import resolve
from .static_plan import StageSpec, parse_plan, validate

log = logging.getLogger(__name__)


def build_config(args) -> tuple[NodeConfig, int]:
    """Resolve the model and the plan from CLI arguments; returns (config, context tokens).

    Raises:
        ModelNotFound, ModelFormatError, PlanError: with a message naming the problem.
    """
    location = resolve(args.model)
    info = model_info(location)
    address = f"{args.host}:{args.port}"
    if args.plan:
        plan = parse_plan(args.plan)
    else:
        plan = [StageSpec(address=address, start=0, end=info.num_layers)]
    validate(plan, info.num_layers)
    if address not in {s.address for s in plan}:
        from .errors import PlanError

        raise PlanError(f"this node's address {address} is not a stage of --plan; pass --host/--port to match")
    return NodeConfig(host=args.host, port=args.port, model=location, plan=plan, dtype=args.dtype,
                      node_id=getattr(args, "node_id", "") or ""), info.context_tokens


async def serve(args) -> int:
    """Run the daemon until SIGINT/SIGTERM. Returns the exit code."""
    tune_allocator()
    config, context = build_config(args)
    node = Node(config)
    # The tokenizer first, so the memory figure taken before the stage loads
    # (node.memory["rss_before_load_bytes"]) is that of a daemon holding no weights.
    tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, config.model)
    await node.start()
    app = create_app(node, tokenizer, config.model.name, context)
    server = uvicorn.Server(uvicorn.Config(app, host=args.api_host, port=args.api_port, log_level="warning",
                                           lifespan="off", access_log=False))
    spec = node.stage_spec
    log.info("serving %s layers [%d, %d) as stage %d of %d; API on http://%s:%d", config.model.name,
             spec.start, spec.end, node.index, len(config.plan), args.api_host, args.api_port)
    try:
        await server.serve()
    finally:
        await node.stop()
    return 0
