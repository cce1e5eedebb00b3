"""The model's tokenizer, built on a node's first API request.

Every node serves the API, but most requests reach one or two of them (the address a
client was given). Building the tokenizer imports transformers (about 1 s of CPU and
tens of MB) and converts the vocabulary (a fraction of a second from the converted
copy in the machine cache, seconds for a large vocabulary the first time). A node
therefore builds it when it first needs it: its first request that renders or decodes
text, or the first grammar its last stage applies. That request waits for it, once;
the node's start, its ring work and its other endpoints never do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class LazyTokenizer:
    """Builds a tokenizer once, on first use, from any thread or the event loop.

    Args:
        load: builds the tokenizer (an mlx-lm ``TokenizerWrapper``); may raise
            ``ModelFormatError``, which every caller then gets.
    """

    def __init__(self, load: Callable[[], Any]):
        self._load = load
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def value(self) -> Any:
        """The tokenizer, once built.

        Raises:
            RuntimeError: not built yet (call :meth:`get` or :meth:`get_blocking` first).
        """
        if self._value is None:
            raise RuntimeError("the tokenizer is not built yet: await LazyTokenizer.get() first")
        return self._value

    @property
    def built(self) -> bool:
        """Whether the tokenizer has been built."""
        return self._value is not None

    def get_blocking(self) -> Any:
        """The tokenizer, built now if needed (blocks the calling thread; never call it on
        the event loop).

        Raises:
            the loader's exception (every later call raises it again).
        """
        if self._value is not None:
            return self._value
        with self._lock:
            if self._value is None and self._error is None:
                t0 = time.perf_counter()
                try:
                    self._value = self._load()
                except BaseException as exc:
                    self._error = exc
                    raise
                log.info("tokenizer built in %.2f s, on first use", time.perf_counter() - t0)
            if self._error is not None:
                raise self._error
            return self._value

    async def get(self) -> Any:
        """The tokenizer, built on a worker thread if needed (the event loop never blocks)."""
        if self._value is not None:
            return self._value
        return await asyncio.to_thread(self.get_blocking)
