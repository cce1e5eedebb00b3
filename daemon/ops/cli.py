"""The ``ringlet`` command line.

Subcommands: ``run`` (the daemon), ``generate`` (one process, no network: the
reference path, same engine), ``chat`` (a client of any node's API), ``demo`` (a
local N-node cluster on the bundled model), ``plan`` (the planner on a nodes file).

Errors print one ``error: ...`` line and exit with status 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from ringlet.daemon.engine.defaults import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK
from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops import logs
from ringlet.daemon.ops.secret import positive_int

DEFAULT_GRPC_PORT = 7100
DEFAULT_API_PORT = 8000


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model path (MLX/HF directory or .gguf) or short name (default: smollm2-135m)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="dequantize/cast weights to this dtype (default: the model's own precision)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringlet", description="Run a language model across a ring of machines.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines (for services)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon (a node of the cluster)")
    _add_model_args(run)
    run.add_argument("--host", default="127.0.0.1", help="gRPC address to bind and advertise (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port")
    run.add_argument("--api-host", default="127.0.0.1", help="HTTP API bind address")
    run.add_argument("--api-port", type=int, default=DEFAULT_API_PORT, help="HTTP API port")
    run.add_argument("--plan", default=None,
                     help="static plan, ring order: HOST:PORT=START:END,... (half-open layer ranges); "
                          "without it the cluster forms by discovery and negotiated plans")
    run.add_argument("--no-dashboard", action="store_true",
                     help="do not draw the live dashboard (it is shown when stdout is a terminal)")
    run.add_argument("--fetch-model", action="store_true",
                     help="the model is not on this machine: pull its shards from a member (negotiated mode)")
    run.add_argument("--advertise-host", default=None, help="address peers dial (default: --host)")
    run.add_argument("--cluster", default="ringlet", help="cluster name; nodes of other clusters are ignored")
    run.add_argument("--data-dir", default=None, help="node id, caches (default: ~/.local/share/ringlet)")
    run.add_argument("--interface", action="append", default=None,
                     help="mDNS on this interface or IPv4 address (repeatable; default: every multicast "
                          "interface; 127.0.0.1 for a cluster on one machine)")
    run.add_argument("--peers", default=None, help="HOST:PORT,... to dial directly where multicast is blocked")
    run.add_argument("--no-mdns", action="store_true", help="do not advertise or browse mDNS (use --peers)")
    run.add_argument("--memory-limit", default=None, help="usable memory to offer the cluster, e.g. 8GB")
    run.add_argument("--policy", choices=["balanced", "memory", "latency"], default="balanced",
                     help="planner policy (default balanced)")
    run.add_argument("--context", type=int, default=None, help="context tokens to size KV caches for")
    run.add_argument("--mode", choices=["auto", "pipeline", "tensor", "hybrid"], default="auto",
                     help="auto (default: decided from memory, links and predicted speed), pipeline, tensor "
                          "(tensor parallel over MLX distributed whenever the members can; else the pipeline, "
                          "saying why), or hybrid (tensor groups chained as pipeline stages; needs 4+ members "
                          "in equal groups whose size the heads divide by)")
    run.add_argument("--heartbeat-s", type=float, default=0.5, help="seconds between heartbeats")
    run.add_argument("--remove-after-s", type=float, default=2.0,
                     help="a member silent this long is removed and the cluster re-plans")
    run.add_argument("--settle-s", type=float, default=0.3, help="membership quiet time before re-planning")
    run.add_argument("--initial-settle-s", type=float, default=1.0, help="quiet time before the first plan")
    run.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                     help=f"most decode steps a stage runs as one batch (1: no batching; default {DEFAULT_MAX_BATCH})")
    run.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                     help=f"prompt tokens per prefill chunk (default {DEFAULT_PREFILL_CHUNK})")
    run.add_argument("--node-id", default="", help=argparse.SUPPRESS)
    from ringlet.daemon.ops.secret import add_run_arguments

    add_run_arguments(run)  # --secret-file, --api-key-file, limits

    gen = sub.add_parser("generate", help="generate in this process, without network (reference path)")
    _add_model_args(gen)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print prompt and completion token ids as JSON")

    chat = sub.add_parser("chat", help="chat with a running cluster through any node's API")
    chat.add_argument("message", nargs="?", help="one message (omit for an interactive session)")
    chat.add_argument("--api", default=f"http://127.0.0.1:{DEFAULT_API_PORT}", help="a node's API base URL")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="send the first key of this file as a bearer key (nodes run with --api-key-file); "
                           "default: $RINGLET_API_KEY")

    demo = sub.add_parser("demo", help="start N local daemons on the bundled model, ask one question, stop")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--question", default="What is the capital of France?")
    _add_model_args(demo)

    for module in _extensions():
        try:
            module.add_parsers(sub)
        except Exception as exc:  # a broken extension must not take `ringlet run` down
            print(f"warning: the {module.__name__} commands are unavailable: {exc}", file=sys.stderr)
    return parser


#: Modules that contribute subcommands. Each exposes ``COMMANDS`` (names),
#: ``add_parsers(subparsers)`` and ``run(args) -> int``.
EXTENSIONS = ("plan", "commands", "secret")


def _extensions() -> list:
    import importlib

    found = []
    for name in EXTENSIONS:
        try:
            found.append(importlib.import_module(f"{__package__}.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{name}":
                print(f"warning: the {name} commands are unavailable: {exc}", file=sys.stderr)
        except Exception as exc:  # a broken extension must not take `ringlet run` down
            print(f"warning: the {name} commands are unavailable: {exc}", file=sys.stderr)
    return found


def _generate(args) -> int:
    from ringlet.daemon.cluster.static_plan import StageSpec
    from ringlet.daemon.engine.model_info import load_tokenizer, model_info
    from ringlet.daemon.engine.sampling import SamplingParams
    from ringlet.daemon.engine.sources import resolve
    from ringlet.daemon.node import Node, NodeConfig

    location = resolve(args.model)
    info = model_info(location)
    tokenizer = load_tokenizer(location)
    if args.chat:
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                    add_generation_prompt=True))
    else:
        prompt = tokenizer.encode(args.prompt)
    if not 0 <= args.temperature <= 2:
        raise RingletError("--temperature must be within [0, 2]")
    config = NodeConfig(host="local", port=0, model=location, dtype=args.dtype,
                        plan=[StageSpec(address="local:0", start=0, end=info.num_layers)])

    async def run() -> list[int]:
        node = Node(config)
        await node.start(serve_grpc=False)
        tokens: list[int] = []
        try:
            sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
            detok = tokenizer.detokenizer
            async for tok in node.generate(prompt, args.max_tokens, sampling, tokenizer.eos_token_ids):
                tokens.append(tok)
                if not args.json and tok not in tokenizer.eos_token_ids:
                    before = len(detok.text)
                    detok.add_token(tok)
                    sys.stdout.write(detok.text[before:])
                    sys.stdout.flush()
            if not args.json:
                before = len(detok.text)
                detok.finalize()
                sys.stdout.write(detok.text[before:] + "\n")
        finally:
            await node.stop()
        return tokens

    tokens = asyncio.run(run())
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "completion_ids": tokens}))
    return 0


def _chat(args) -> int:
    from ringlet.daemon.ops.client import chat_loop
    from ringlet.daemon.wire.auth import client_api_key

    return chat_loop(args.api, args.message, args.max_tokens, args.temperature, client_api_key(args.api_key_file))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ringlet`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # transformers (used for tokenizers only) prints advisories on stderr; keep errors.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logs.setup(args.verbose, args.log_json, quiet=args.command in ("generate", "chat", "plan"))
    try:
        if args.command == "run":
            from ringlet.daemon.ops.runner import serve

            return asyncio.run(serve(args))
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "demo":
            from ringlet.daemon.ops.demo import run_demo

            return run_demo(args.nodes, args.question, args.model, args.dtype)
        for module in _extensions():
            if args.command in module.COMMANDS:
                return module.run(args)
    except KeyboardInterrupt:
        return 130
    except (RingletError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


def entry() -> None:
    """Console-script entry: run :func:`main`, then leave without running interpreter
    finalisers. MLX's scheduler threads, once used from a worker thread, can abort the
    process ("terminate called without an active exception") when C++ static
    destructors run at exit; the work is done and flushed by then."""
    import logging

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    entry()
