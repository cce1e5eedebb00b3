"""Regenerate the gRPC Python code in ``daemon/wire/rpc/`` from ``proto/ringlet.proto``.

Run with ``make proto`` (``python -m ringlet.daemon.wire.rpc.generate``). ``grpc_tools``
writes ``import ringlet_pb2``; that line is rewritten to a package-relative import
so the generated modules work inside ``ringlet.daemon.wire.rpc``.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

RPC_DIR = Path(__file__).resolve().parent
PROTO_DIR = RPC_DIR.parents[2] / "proto"
GENERATED = ("ringlet_pb2.py", "ringlet_pb2.pyi", "ringlet_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on ``proto/ringlet.proto`` and write the three modules to ``out_dir``.

    Raises:
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # test extra; imported lazily

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "ringlet.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/ringlet.proto")
    grpc_file = out_dir / "ringlet_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import ringlet_pb2 as", "from . import ringlet_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / name for name in GENERATED]


def main() -> int:
    """Regenerate into a temp dir, then copy over the committed files."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (RPC_DIR / path.name).write_text(path.read_text())
    print(f"regenerated {', '.join(GENERATED)} in {RPC_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
