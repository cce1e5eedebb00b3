"""Regenerate the gRPC Python code in ``daemon/wire/rpc/`` from ``proto/ringlet.proto``,
and keep a release's compiled descriptor.

Run with ``make proto`` (``python -m ringlet.daemon.wire.rpc.generate``). ``grpc_tools``
writes ``import ringlet_pb2``; that line is rewritten to a package-relative import
so the generated modules work inside ``ringlet.daemon.wire.rpc``.

``python -m ringlet.daemon.wire.rpc.generate --release`` writes
``proto/released/<version>.binpb`` (:func:`descriptor_set` of the current proto) and
``<version>.json`` (pyproject.toml's version, this build's wire protocol version): the
descriptor the next release's wire is checked against (:mod:`ringlet.daemon.wire.compat`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import tomllib
from pathlib import Path

RPC_DIR = Path(__file__).resolve().parent
PROTO_DIR = RPC_DIR.parents[2] / "proto"
RELEASED_DIR = PROTO_DIR / "released"
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


def descriptor_set(proto_text: str | None = None) -> bytes:
    """The serialized FileDescriptorSet of ``proto_text`` (default: ``proto/ringlet.proto``),
    compiled as ``protoc --descriptor_set_out --include_imports`` with the file named
    ``ringlet.proto``: the form releases are kept in.

    Raises:
        RuntimeError: protoc reported an error.
    """
    import grpc_tools
    from grpc_tools import protoc

    text = (PROTO_DIR / "ringlet.proto").read_text() if proto_text is None else proto_text
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ringlet.proto").write_text(text)
        out = Path(tmp) / "ringlet.binpb"
        args = ["protoc", f"-I{tmp}", f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
                f"--descriptor_set_out={out}", "--include_imports", "ringlet.proto"]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on ringlet.proto")
        return out.read_bytes()


def write_release() -> Path:
    """Keep the current proto's descriptor as this release's (pyproject.toml's version)."""
    from ringlet.daemon.wire.versions import PROTOCOL_VERSION

    version = tomllib.loads((PROTO_DIR.parent / "pyproject.toml").read_text())["project"]["version"]
    RELEASED_DIR.mkdir(exist_ok=True)
    target = RELEASED_DIR / f"{version}.binpb"
    target.write_bytes(descriptor_set())
    meta = {"release": version, "protocol_version": PROTOCOL_VERSION,
            "made_with": "python -m ringlet.daemon.wire.rpc.generate --release"}
    target.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    """Regenerate into a temp dir, then copy over the committed files; with
    ``--release``, write this release's descriptor instead."""
    parser = argparse.ArgumentParser(prog="python -m ringlet.daemon.wire.rpc.generate")
    parser.add_argument("--release", action="store_true",
                        help="write proto/released/<pyproject version>.binpb and .json (when cutting a release)")
    if parser.parse_args(argv).release:
        print(f"wrote {write_release()}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (RPC_DIR / path.name).write_text(path.read_text())
    print(f"regenerated {', '.join(GENERATED)} in {RPC_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
