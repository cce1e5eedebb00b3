"""The keepalive ticker (:mod:`ringlet.daemon.api.ticker`) alone, without a daemon."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ringlet.daemon.api import ticker
from ringlet.daemon.api.request import Keepalive, PromptProgress, TextDelta


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(ticker.KEEPALIVE_ENV, raising=False)
    assert ticker.keepalive_interval() == ticker.KEEPALIVE_S <= 10
    monkeypatch.setenv(ticker.KEEPALIVE_ENV, "0.5")
    assert ticker.keepalive_interval() == 0.5
    for bad in ("x", "0", "-1"):
        monkeypatch.setenv(ticker.KEEPALIVE_ENV, bad)
        assert ticker.keepalive_interval() == ticker.KEEPALIVE_S


def test_keepalives_progress_and_closing_cancels_the_wait():
    cleaned = []

    async def slow():
        try:
            yield TextDelta("a")
            await asyncio.sleep(0.35)  # a long prefill: nothing for a while
            yield TextDelta("b")
            await asyncio.sleep(10)  # the client leaves during this wait
            yield TextDelta("never")
        finally:
            cleaned.append(True)

    async def main():
        progress: asyncio.Queue[PromptProgress] = asyncio.Queue()
        progress.put_nowait(PromptProgress(10, 0, 4, 1))
        progress.put_nowait(PromptProgress(10, 0, 8, 2))  # only the newest of two waiting goes out
        got = []
        async with contextlib.aclosing(ticker.with_ticks(slow(), 0.1, progress)) as events:
            async for event in events:
                got.append(event)
                if isinstance(event, Keepalive) and TextDelta("b") in got:
                    break  # the client left while the source waits
        for _ in range(20):
            if cleaned:
                break
            await asyncio.sleep(0.01)
        return got

    got = asyncio.run(main())
    assert got[0] == PromptProgress(10, 0, 8, 2) and got[1] == TextDelta("a")
    assert got[-2:] == [TextDelta("b"), Keepalive()] and 3 <= sum(isinstance(e, Keepalive) for e in got) <= 5
    assert cleaned == [True]  # the source's wait was cancelled and its cleanup ran


@pytest.mark.parametrize("error", [ValueError("boom")])
def test_a_source_error_reaches_the_consumer(error):
    async def failing():
        yield TextDelta("a")
        raise error

    async def main():
        out = []
        with pytest.raises(ValueError, match="boom"):
            async for event in ticker.with_ticks(failing(), 1.0):
                out.append(event)
        return out

    assert asyncio.run(main()) == [TextDelta("a")]
