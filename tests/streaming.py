"""Reading a streamed completion (server-sent events) the way the tests need it:
token ids with their arrival times, the finish reason and an error event, either
inline (:func:`read_events`) or in a background thread (:class:`Stream`)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx


@dataclass
class Streamed:
    """What a streamed completion delivered so far."""

    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() at each token's arrival
    finish: str | None = None
    error: str | None = None

    def gaps(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def max_gap_s(self) -> float:
        return max(self.gaps(), default=0.0)


def read_events(lines: Iterable[str], into: Streamed, on_token: Callable[[int], None] | None = None) -> Streamed:
    """Parse ``data:`` lines of an OpenAI completion stream into ``into`` (token ids need
    ``return_token_ids``); ``on_token(n)`` is called after the n-th token."""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            into.error = event["error"]["message"]
            continue
        choice = event["choices"][0]
        for t in choice.get("token_ids") or []:
            into.ids.append(t)
            into.times.append(time.monotonic())
            if on_token is not None:
                on_token(len(into.ids))
        into.finish = choice.get("finish_reason") or into.finish
    return into


def completion_body(prompt: str, max_tokens: int) -> dict:
    """A greedy streamed ``/v1/completions`` body that returns token ids."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}


class Stream(Streamed):
    """A greedy streamed completion read in a background thread; ``context`` is entered
    around the request (e.g. a network namespace)."""

    def __init__(self, url: str, prompt: str, max_tokens: int, timeout_s: float = 600,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        super().__init__()
        self.thread = threading.Thread(target=self._run, args=(url, prompt, max_tokens, timeout_s, context),
                                       daemon=True)
        self.thread.start()

    def _run(self, url: str, prompt: str, max_tokens: int, timeout_s: float, context) -> None:
        try:
            with context(), httpx.Client(trust_env=False) as client, \
                    client.stream("POST", f"{url}/v1/completions", json=completion_body(prompt, max_tokens),
                                  timeout=timeout_s) as r:
                read_events(r.iter_lines(), self)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = repr(exc)

    def wait_tokens(self, n: int, timeout_s: float) -> None:
        """Wait until ``n`` tokens came (or the stream ended); fails the test after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.ids) < n and self.thread.is_alive():
            assert time.monotonic() < deadline, f"only {len(self.ids)} tokens after {timeout_s} s"
            time.sleep(0.02)

    def join(self, timeout_s: float) -> None:
        """Wait for the stream to end; fails the test after ``timeout_s``."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not finish"
