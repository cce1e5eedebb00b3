"""The field policy of every API surface: honoured, accepted hint, or refused.

Clients send more than the fields that shape an answer: metadata, billing headers,
cache hints, beta flags, tools ringlet cannot run. The rule (``docs/api.md`` has the
table, surface by surface):

- **honoured**: the field does what the vendor documents;
- **accepted hint**: the field cannot change the generated tokens (metadata, ``user``,
  ``service_tier``, ``store: false``, ``cache_control``, ``thinking.display``,
  ``reasoning.summary``, a hosted tool ringlet leaves out of the prompt...). It is
  accepted, named in the ``ringlet-ignored`` response header, and logged once per node
  and surface, so nothing is ignored in silence;
- **refused**: the field would change the answer and ringlet cannot do it: a 400
  naming it (:func:`ringlet.daemon.api.errors.unsupported`).

An adapter collects the hints of one request in :class:`Ignored` (its conversion adds
names as it meets them) and sends :meth:`Ignored.headers` with the response.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

#: the response header naming the accepted hints a request carried
HEADER = "ringlet-ignored"

_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


class Ignored:
    """The accepted-but-not-applied fields of one request, in the order met.

    Args:
        surface: the API surface, for the log (``chat.completions``, ``messages``,
            ``responses``, ``completions``).
        names: hints already met (e.g. by the body's conversion).
    """

    def __init__(self, surface: str, names: list[str] | tuple[str, ...] = ()):
        self.surface = surface
        self.names: list[str] = []
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        """Record field ``name`` (a dotted path, a header or a tool type) once."""
        if name not in self.names:
            self.names.append(name)

    def __bool__(self) -> bool:
        return bool(self.names)

    def headers(self) -> dict[str, str]:
        """The response header naming the hints (``{}`` when there are none; characters
        past ASCII escaped as ``\\uXXXX``); logs each hint the first time this process
        meets it on this surface."""
        if not self.names:
            return {}
        with _lock:
            new = [n for n in self.names if (self.surface, n) not in _logged]
            _logged.update((self.surface, n) for n in new)
        for name in new:
            log.info("%s: accepted %s as a hint and did not apply it (it cannot change the tokens); "
                     "responses name it in the %s header", self.surface, name, HEADER)
        # a client's own key (``stream_options.<key>``) may hold any character; a header
        # value is latin-1, so anything past ASCII goes as its escape
        return {HEADER: ", ".join(self.names).encode("ascii", "backslashreplace").decode("ascii")}
