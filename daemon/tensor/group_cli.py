"""A manual run of a tensor group: ``python -m ringlet.daemon.tensor.group_cli --ranks 3 "Once upon a time"``.

Starts a local :class:`~ringlet.daemon.tensor.group.TPGroup` (every rank on 127.0.0.1),
generates once from the prompt and prints the text, then the group's mode, backend,
ranks and reason on stderr.
"""

from __future__ import annotations

import asyncio
import sys

from ringlet.daemon.errors import RingletError
from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.group_errors import TPGroupError
from ringlet.daemon.tensor.planning.decision import TPRefused


def main(argv: list[str] | None = None) -> int:
    """``python -m ringlet.daemon.tensor.group_cli --ranks 3 "Once upon a time"``: a local group on 127.0.0.1."""
    import argparse
    import json

    from ringlet.daemon.engine.model_info import load_tokenizer
    from ringlet.daemon.engine.sources import resolve

    p = argparse.ArgumentParser(description="Run a tensor-parallel group of local ranks (127.0.0.1) once")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or 'model'")
    p.add_argument("--mode", default="tensor", help="tensor (refuse when impossible) or auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    args = p.parse_args(argv)
    dtype = None if args.dtype == "model" else args.dtype
    tok = load_tokenizer(resolve(args.model))
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(args.prompt)

    async def run() -> None:
        group = TPGroup.local(args.model, args.ranks, dtype=dtype, mode=None if args.mode == "auto" else args.mode)
        try:
            await group.start()
            detok = tok.detokenizer
            async for t in group.generate(ids, args.max_tokens, stop_ids=sorted(tok.eos_token_ids)):
                if t not in tok.eos_token_ids:
                    detok.add_token(t)
                    print(detok.last_segment, end="", flush=True)
            detok.finalize()
            print(detok.last_segment)
            info = group.info()
            print(json.dumps({k: info[k] for k in ("mode", "backend", "ranks", "reason")}), file=sys.stderr)
        finally:
            await group.close()

    try:
        asyncio.run(run())
    except (TPRefused, TPGroupError, RingletError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
