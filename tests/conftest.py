"""Shared fixtures: the default model, tiny random mlx-lm models, local clusters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet.daemon.probes import blas

# In-process tests run MLX as ringlet's own processes do: on the optimized BLAS,
# loaded before anything imports mlx.core (daemons and ranks load it themselves).
blas.load()

TESTS = Path(__file__).parent
REFERENCE = json.loads((TESTS / "smollm2_135m_instruct_greedy.json").read_text())


def ringlet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``ringlet`` CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "ringlet.daemon.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def reference() -> list[dict]:
    """Greedy continuations of SmolLM2-135M-Instruct computed by transformers (fp32)."""
    return REFERENCE


@pytest.fixture(scope="session")
def default_location():
    from ringlet.daemon.engine.sources import resolve

    return resolve(None)
