"""The stage engine on its own (a real tiny model's stage, no network): what it refuses."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import make_tiny_model

from ringlet.daemon.engine.scheduler import RequestError, StageEngine
from ringlet.daemon.engine.sources import resolve
from ringlet.daemon.engine.stage import load_stage


def test_token_ids_outside_the_vocabulary_fail_the_request_not_the_process(tmp_path):
    """The tiny llama has 160 embedding entries (tiny_models.CONFIGS): id 160 or -1 would read
    outside the table (MLX does not check; the process would crash). The step fails with the
    reason and the next request is served."""
    location = resolve(str(make_tiny_model("llama", tmp_path / "llama")))

    async def go():
        engine = await StageEngine.create(lambda: load_stage(location, 0, 2, "float32"))
        try:
            for bad in (160, -1):
                with pytest.raises(RequestError, match=rf"token id {bad} is outside the vocabulary \[0, 160\)"):
                    await engine.submit(f"r{bad}", 0, 0, [5, bad], None)
            out = await engine.submit("ok", 0, 0, [5, 159], None)
            return list(out.shape)
        finally:
            engine.close()

    assert asyncio.run(go()) == [1, 2, 64]
