"""The node's prefill chunk: a ring of several stages prefills in half the one-stage
chunk (the pipeline's tail is about one chunk: bench_prefill_pipeline), unless
``--prefill-chunk`` sets one for both."""

from __future__ import annotations

from ringlet.daemon.engine.defaults import CPU_PREFILL_CHUNK
from ringlet.daemon.node.config import NodeConfig


def test_a_ring_prefills_in_half_chunks_by_default(default_location):
    config = NodeConfig(host="127.0.0.1", port=1, model=default_location)
    assert config.chunk_for(1) == CPU_PREFILL_CHUNK == 256  # this machine has no GPU
    assert config.chunk_for(2) == config.chunk_for(3) == 128


def test_a_chunk_given_serves_every_plan(default_location):
    config = NodeConfig(host="127.0.0.1", port=1, model=default_location, prefill_chunk=64)
    assert config.chunk_for(1) == config.chunk_for(4) == 64
