"""Streamed text, split into what the client sees: visible text cut at stop strings,
and tool calls between their markers."""

from __future__ import annotations


def whole_characters(text: str) -> str:
    """``text`` without the replacement characters at its end: mlx-lm's detokenizer holds
    back bytes until they complete a UTF-8 character and, on ``finalize``, decodes an
    incomplete rest as U+FFFD. A reply cut there (by ``max_tokens``, or an end token
    after part of a character) ends with whole characters only, as OpenAI's API does;
    ``usage.completion_tokens`` still counts every token."""
    return text.rstrip("\ufffd")


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class TextSplitter:
    """Splits streamed text into ``("text", s)`` parts and tool calls.

    Visible text never contains a stop string (the text ends before the first one,
    and :attr:`stopped` is set) nor a tool-call marker; a possible start of either is
    held back until the next piece decides it. Between ``markers`` (start, end) text is
    a call body; stop strings do not apply inside a call. An end marker of "" means a
    call runs to the end of the output.

    A call comes as ``("body", piece)`` parts while it is written (everything but a
    possible start of the end marker is passed on), then ``("call", body)`` with the
    whole body at its end marker, or ``("cut", body)`` when the output ends before it.

    Args:
        stops: stop strings (each non-empty).
        markers: ``(start, end)`` of a tool call, or ``None`` when no tools are on.
    """

    def __init__(self, stops: list[str], markers: tuple[str, str] | None = None):
        self.stops = [s for s in stops if s]
        self.markers = markers
        self.seen = ""  # all text fed so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._buf = ""  # text not yet emitted
        self._in_call = False
        self._body = ""  # the call's body given out so far

    def _hold(self) -> int:
        lengths = [len(s) for s in self.stops]
        if self.markers is not None:
            lengths.append(len(self.markers[0]))
        return max(lengths, default=1) - 1

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Add text; return the parts that are decided."""
        if self.stopped:
            return []
        self.seen += piece
        self._buf += piece
        out: list[tuple[str, str]] = []
        while self._buf and not self.stopped:
            if self._in_call:
                end = self.markers[1]
                cut = self._buf.find(end) if end else -1
                if cut < 0:
                    self._body_piece(len(self._buf) - _marker_start(self._buf, end), out)
                    return out
                self._body_piece(cut, out)
                out.append(("call", self._body))
                self._buf = self._buf[len(end):]
                self._in_call, self._body = False, ""
                continue
            stop = min((i for s in self.stops if (i := self._buf.find(s)) >= 0), default=-1)
            start = self._buf.find(self.markers[0]) if self.markers is not None else -1
            if start >= 0 and (stop < 0 or start < stop):
                if start:
                    out.append(("text", self._buf[:start]))
                self._buf = self._buf[start + len(self.markers[0]):]
                self._in_call = True
                continue
            if stop >= 0:
                if stop:
                    out.append(("text", self._buf[:stop]))
                self.matched = min((s for s in self.stops if self._buf.find(s) == stop), key=len)
                self._buf = ""
                self.stopped = True
                return out
            safe = len(self._buf) - self._hold()
            if safe > 0:
                out.append(("text", self._buf[:safe]))
                self._buf = self._buf[safe:]
            return out
        return out

    def _body_piece(self, size: int, out: list[tuple[str, str]]) -> None:
        """Give out the first ``size`` characters held as a piece of the call's body."""
        if size > 0:
            piece, self._buf = self._buf[:size], self._buf[size:]
            self._body += piece
            out.append(("body", piece))

    def flush(self) -> list[tuple[str, str]]:
        """The parts held back, at the end of the output: the rest of the text, or the
        end of an unfinished call (``"call"`` when its end marker is "", else ``"cut"``)."""
        if self._in_call and not self.stopped:
            out: list[tuple[str, str]] = []
            self._body_piece(len(self._buf), out)
            out.append(("cut" if self.markers[1] else "call", self._body))
            self._in_call, self._body = False, ""
            return out
        if self.stopped or not self._buf:
            self._buf = ""
            return []
        rest, self._buf = self._buf, ""
        return [("text", rest)]
