"""The committed generated code matches proto/ringlet.proto (``make proto`` regenerates it)."""

from __future__ import annotations

from pathlib import Path

from ringlet.daemon.wire.rpc import generate


def test_generated_code_is_not_stale(tmp_path: Path):
    for fresh in generate.generate(tmp_path):
        committed = generate.RPC_DIR / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `make proto` and commit the result"
        )
