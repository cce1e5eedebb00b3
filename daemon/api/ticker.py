"""Keeping a stream alive through a long prefill: :func:`with_ticks` merges a generation's
event stream with a timer and with prefill progress, so an adapter has something to send
(and a moment to check whether its client left) at least every
:func:`keepalive_interval` seconds, before the first token as after it.

Closing the merged stream (the client left) cancels the generation where it waits: on
stage 0 that is between two prefill chunks, and the node's cleanup releases the
request's KV cache around the ring (:meth:`ringlet.daemon.node.head.Head._release`).
That cleanup runs in a task of its own, so the server cancelling the response's task
cannot cut it short.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Protocol

from ringlet.daemon.api.request import Event, Keepalive, PromptProgress

#: the longest a stream stays silent, seconds (issue #35: at least every 10 s)
KEEPALIVE_S = 5.0
#: environment variable overriding :data:`KEEPALIVE_S` (seconds; tests lower it)
KEEPALIVE_ENV = "RINGLET_KEEPALIVE_S"

_cleanups: set[asyncio.Task] = set()  # closing generations: kept referenced until done


def keepalive_interval() -> float:
    """The keepalive interval, seconds: ``$RINGLET_KEEPALIVE_S`` when it is a positive
    number, else :data:`KEEPALIVE_S`."""
    try:
        value = float(os.environ.get(KEEPALIVE_ENV, ""))
    except ValueError:
        return KEEPALIVE_S
    return value if value > 0 else KEEPALIVE_S


async def _close(pending: asyncio.Task | None, source: AsyncIterator[Event]) -> None:
    if pending is not None and not pending.done():
        pending.cancel()  # raises CancelledError where the generation waits (between prefill chunks)
    if pending is not None:
        await asyncio.wait([pending])
        if not pending.cancelled():
            pending.exception()  # retrieved: no "exception never retrieved" warning
    await source.aclose()  # type: ignore[attr-defined]


async def with_ticks(source: AsyncIterator[Event], interval_s: float,
                     progress: asyncio.Queue[PromptProgress] | None = None) -> AsyncIterator[Event]:
    """``source``'s events, with a :class:`Keepalive` whenever ``interval_s`` seconds
    pass without any, and the :class:`PromptProgress` items put on ``progress`` (the
    newest one only, when several wait; before an event of ``source`` that comes at the
    same time)."""
    pending: asyncio.Task | None = None
    getter: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))  # type: ignore[arg-type]
            waits: set[asyncio.Future] = {pending}
            if progress is not None:
                getter = getter or asyncio.ensure_future(progress.get())
                waits.add(getter)
            done, _ = await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield Keepalive()
                continue
            if getter is not None and getter in done:
                latest = getter.result()
                getter = None
                while progress is not None and not progress.empty():
                    latest = progress.get_nowait()
                yield latest
            if pending in done:
                task, pending = pending, None
                try:
                    event = task.result()
                except StopAsyncIteration:
                    return
                yield event
    finally:
        if getter is not None:
            getter.cancel()
        cleanup = asyncio.ensure_future(_close(pending, source))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)


#: how often, seconds, :func:`until_gone` asks whether the client is still there
GONE_CHECK_S = 0.25


class ClientGone(Exception):
    """The client of a whole (non-streamed) reply closed its connection; its generation
    was stopped. The app answers it with status 499 (nobody reads it)."""


class _Disconnectable(Protocol):
    async def is_disconnected(self) -> bool: ...


async def until_gone(source: AsyncIterator[Event], request: _Disconnectable) -> AsyncIterator[Event]:
    """``source``'s events until the client of ``request`` (a Starlette request) leaves;
    then :class:`ClientGone`, raised after ``source`` is closed (which stops the generation
    between two prefill chunks or decode steps and releases its KV caches). Asked at most
    every :data:`GONE_CHECK_S` seconds and at every :class:`Keepalive`, so a whole reply
    whose client left during a long prefill stops within one keepalive interval."""
    last = time.monotonic()
    try:
        async for event in source:
            now = time.monotonic()
            if isinstance(event, Keepalive) or now - last >= GONE_CHECK_S:
                last = now
                if await request.is_disconnected():
                    raise ClientGone("the client closed the connection")
            yield event
    finally:
        await source.aclose()  # type: ignore[attr-defined]
