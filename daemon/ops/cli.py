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

from ringlet.daemon.errors import RingletError
from ringlet.daemon.ops import logs
from ringlet.daemon.ops.run_options import (
    DEFAULT_API_PORT,
    add_global_options,
    add_model_args,
    add_run_parser,
)
from ringlet.daemon.wire import versions


def version_line() -> str:
    """``ringlet --version``'s line: release, wire protocol version and capabilities."""
    return (f"ringlet {versions.RELEASE} (wire protocol {versions.PROTOCOL_VERSION}; "
            f"capabilities: {', '.join(sorted(versions.CAPABILITIES))})")


class _Version(argparse.Action):
    """``--version``: :func:`version_line` on one line (argparse's own action wraps it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringlet", description="Run a language model across a ring of machines.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the release, the wire protocol version and the capabilities, then exit")
    add_global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_run_parser(sub)

    gen = sub.add_parser("generate", help="generate in this process, without network (reference path)")
    add_model_args(gen)
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
    chat.add_argument("--model", default=None, help="the model to ask, by name or alias (a node serving several; "
                                                    "default: its first)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="send the first key of this file as a bearer key (nodes run with --api-key-file); "
                           "default: $RINGLET_API_KEY")

    demo = sub.add_parser("demo", help="start N local daemons on the bundled model, ask one question, stop")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--question", default="What is the capital of France?")
    add_model_args(demo)

    for module in _extensions():
        try:
            module.add_parsers(sub)
        except Exception as exc:  # a broken extension must not take `ringlet run` down
            print(f"warning: the {module.__name__} commands are unavailable: {exc}", file=sys.stderr)
    return parser


#: Commands that run MLX in this process (they load the optimized BLAS first).
MLX_COMMANDS = frozenset({"run", "generate", "demo", "doctor"})

#: Modules that contribute subcommands. Each exposes ``COMMANDS`` (names),
#: ``add_parsers(subparsers)`` and ``run(args) -> int``.
EXTENSIONS = ("plan", "commands", "secret", "models")


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
    from ringlet.daemon.engine.model_info import load_tokenizer, model_info
    from ringlet.daemon.ops.models import whole_model

    location = whole_model(args.model)  # before the engine's imports (seconds): a bad model fails at once
    info = model_info(location)
    from ringlet.daemon.engine.sampling import SamplingParams
    from ringlet.daemon.node import Node, NodeConfig
    from ringlet.daemon.ops.runner import node_dtype
    from ringlet.daemon.wire.serving_plan import StageSpec

    choice = node_dtype(args, location)
    tokenizer = load_tokenizer(location)
    if args.chat:
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                    add_generation_prompt=True))
    else:
        prompt = tokenizer.encode(args.prompt)
    if not 0 <= args.temperature <= 2:
        raise RingletError("--temperature must be within [0, 2]")
    config = NodeConfig(host="local", port=0, model=location, dtype=choice.dtype, dtype_choice=choice.to_dict(),
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

    return chat_loop(args.api, args.message, args.max_tokens, args.temperature, client_api_key(args.api_key_file),
                     args.model)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ringlet`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if hasattr(args, "models"):  # ringlet run: --model may be repeated
        args.model = args.models[0] if args.models else None
    if args.command is None:
        parser.print_help()
        return 2
    # transformers (used for tokenizers only) prints advisories on stderr; keep errors.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logs.setup(args.verbose, args.log_json, quiet=args.command in ("generate", "chat", "plan"))
    if args.command in MLX_COMMANDS:
        # Before anything imports mlx.core: MLX's CPU matmuls bind to the BLAS loaded here.
        from ringlet.daemon.probes import blas

        blas.load(getattr(args, "threads", None))
    try:
        if getattr(args, "weights_cache_bytes", None) is not None:
            from ringlet.daemon.engine import dequant_cache
            from ringlet.daemon.ops.run_options import parse_size

            dequant_cache.configure(parse_size(args.weights_cache_bytes, "--weights-cache-bytes", allow_zero=True))
        if args.command == "run":
            from ringlet.daemon.ops.lanes_run import serve_lanes, several_models

            if several_models(args):
                return asyncio.run(serve_lanes(args, list(sys.argv[1:] if argv is None else argv)))
            if args.model_context:  # one model: its --model-context is its --context
                from ringlet.daemon.engine.sources import DEFAULT_MODEL
                from ringlet.daemon.ops.lanes_run import parse_model_contexts

                served = args.model or DEFAULT_MODEL
                args.context = parse_model_contexts(args.model_context, [served])[served]
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
