"""Tool calls streamed while the model writes them.

:class:`~ringlet.daemon.api.text.TextSplitter` hands on a call's body in pieces as they
are decoded; :class:`CallStream` turns them into :class:`ToolCallStart`, then
:class:`ToolCallDelta` pieces of the arguments text, then the complete :class:`ToolCall`.

- **ringlet's format** (``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``,
  :data:`ringlet.daemon.api.prompting.JSON_FORMAT`): :class:`CallScanner` reads the body
  as it grows; the call starts once its name is read and its arguments object begins,
  and the arguments object's text is passed on as it is written. Keys in the other order
  (arguments first) start the call when the name is read, with the arguments so far in
  one piece. A body that never starts a call (not an object, arguments that are not an
  object, a list of calls) is parsed whole at its end marker as before: a call then
  arrives as start + one delta + completion; no call, and the body stays text.
- **A model's native format** (the other mlx-lm tool parsers): the body is parsed at its
  end, and each call arrives as start + one delta with all its arguments + completion.

A call's arguments are the JSON text the model wrote, unchanged (non-ASCII characters as
they are): the deltas joined equal the completion's ``arguments``, streamed or not.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ringlet.daemon.api.prompting import ToolFormat, parse_custom_call
from ringlet.daemon.api.request import Event, TextDelta, Tool, ToolCall, ToolCallDelta, ToolCallStart

_SPACE = " \t\n\r"  # JSON's whitespace


class CallScanner:
    """Reads one call body of ringlet's format, ``{"name": "f", "arguments": {...}}``,
    one piece at a time.

    The body's top-level object is scanned a character at a time: its keys, the
    ``name`` string, and where each value ends (strings with their escapes, the depth
    of nested objects and arrays, scalars up to the next separator). A character of the
    arguments object is decided once read, so nothing inside it is held back; the
    scanner keeps only the text of the key or value it is reading.

    Attributes:
        name: the function's name once its string is read (else ``None``).
        arguments: the arguments object's text read so far, as written.
        started: the call has started (its name is read and its arguments are an object).
        closed: the arguments object is complete.
        failed: the body is not a call of this shape (no call starts any more).
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""
        self.started = self.closed = self.failed = False
        self._state = "begin"  # begin, key?, key, colon, value?, value, after, done
        self._key: str | None = None  # the key whose value is read
        self._text = ""  # the key or (not arguments) value being read, as written
        self._kind = ""  # the value's first character: '"', '{', '[' or a scalar's
        self._depth = 0  # open objects and arrays inside the value
        self._in_string = self._escape = False
        self._sent = 0  # characters of ``arguments`` given out

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Read more of the body.

        Returns:
            ``("start", name)`` when the call starts, then ``("arguments", text)`` with
            the arguments text read since the previous feed (nothing before the start).
        """
        out: list[tuple[str, str]] = []
        for ch in piece:
            if self.failed or (self.started and self.closed):
                break  # the call is whole: what follows its arguments does not change it
            self._step(ch, out)
        if self.started and len(self.arguments) > self._sent:
            out.append(("arguments", self.arguments[self._sent:]))
            self._sent = len(self.arguments)
        return out

    def _step(self, ch: str, out: list[tuple[str, str]]) -> None:
        state = self._state
        if state == "value":
            self._value_char(ch, out)
        elif state == "key":
            self._text += ch
            if self._string_ends(ch):
                self._key = _decoded(self._text)
                self._state = "colon" if self._key is not None else self._fail()
        elif ch in _SPACE:
            return
        elif state == "begin":
            self._expect(ch, "{", "key?")
        elif state == "key?" and ch == '"':
            self._text, self._state = ch, "key"
            self._in_string, self._escape = True, False
        elif state == "key?":
            self._expect(ch, "}", "done")
        elif state == "colon":
            self._expect(ch, ":", "value?")
        elif state == "value?":
            self._begin_value(ch, out)
        elif state == "after" and ch == ",":
            self._state = "key?"
        else:  # after: "}" ends the object; done: only whitespace may follow
            self._expect(ch, "}" if state == "after" else "", "done")

    def _fail(self) -> str:
        self.failed = True
        return "failed"

    def _expect(self, ch: str, wanted: str, then: str) -> None:
        self._state = then if ch == wanted else self._fail()

    def _string_ends(self, ch: str) -> bool:
        """Track a string's escapes; whether ``ch`` is its closing quote."""
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            return True
        return False

    def _begin_value(self, ch: str, out: list[tuple[str, str]]) -> None:
        """The first character of a value."""
        if ch in ",}]":
            self._fail()  # a missing value
            return
        self._text, self._kind, self._state = "", ch, "value"
        self._in_string, self._escape, self._depth = ch == '"', False, int(ch in "{[")
        if self._key == "arguments" and not self.closed:
            if ch != "{":
                self._fail()  # arguments as a string (or else): parsed whole at the end
                return
            if self.name is not None:
                self.started = True
                out.append(("start", self.name))
        self._take(ch)

    def _value_char(self, ch: str, out: list[tuple[str, str]]) -> None:
        """A character of the current value after its first."""
        if self._kind not in '"{[':  # a scalar: it ends before whitespace or a separator
            if ch in _SPACE + ",}]":
                self._end_value(out)
                if not self.failed:
                    self._step(ch, out)
            else:
                self._take(ch)
            return
        self._take(ch)
        if self._in_string:
            if self._string_ends(ch) and self._kind == '"':
                self._end_value(out)
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if not self._depth:
                self._end_value(out)

    @property
    def _capturing(self) -> bool:
        """Whether the value being read is the arguments object."""
        return self._key == "arguments" and self._kind == "{" and not self.closed

    def _take(self, ch: str) -> None:
        if self._capturing:
            self.arguments += ch
        else:
            self._text += ch

    def _end_value(self, out: list[tuple[str, str]]) -> None:
        self._state = "after"
        if self._capturing:
            self.closed = True
        elif self._key == "name" and self.name is None:
            self.name = _decoded(self._text) if self._kind == '"' else None
            if self.name is None:
                self._fail()  # a name that is not a string: not a call
            elif self.closed and not self.started:  # the arguments came first
                self.started = True
                out.append(("start", self.name))


def _decoded(text: str) -> str | None:
    """A JSON string's value (``text`` with its quotes), or ``None`` when it is malformed."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def new_call_id() -> str:
    """A fresh call id, ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_calls(fmt: ToolFormat, body: str, tools: list[Tool]) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` of the calls in a whole call body, or ``None`` when it is
    not a call (the parser raises, or names no function). Arguments the parser returns as
    an object are written back as JSON with their characters unescaped. A forced custom
    tool's raw call (``name`` newline input) is one call with the input as ``input``."""
    if (custom := parse_custom_call(body, tools)) is not None:
        return [custom]
    try:
        parsed = fmt.parse(body, [t.as_openai() for t in tools] or None)
    except Exception:  # noqa: BLE001 - a parser raises on text that is not a call
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args: Any = item.get("arguments", {})
        out.append((item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return out


class CallStream:
    """One choice's tool calls: the splitter's call parts in, events out.

    Args:
        fmt: the request's tool format.
        tools: the request's tools (some parsers read their schemas).
        choice: the choice the events belong to.

    Attributes:
        count: the calls started so far (the next call's index).
    """

    def __init__(self, fmt: ToolFormat, tools: list[Tool], choice: int):
        self.fmt, self.tools, self.choice = fmt, tools, choice
        self.count = 0
        self._scanner: CallScanner | None = None
        self._id = ""

    def take(self, kind: str, text: str) -> list[Event]:
        """The events of one splitter part: ``("body", piece)`` of a call's body,
        ``("call", body)`` at its end marker, or ``("cut", body)`` when the output
        ended inside it. A body that is no call comes back as a :class:`TextDelta`
        with its markers."""
        if kind == "body":
            return self._piece(text)
        scanner, self._scanner = self._scanner, None
        if scanner is not None and scanner.started:  # streamed: complete it, whole or cut
            call = ToolCall(self.count, self._id, scanner.name or "", scanner.arguments, self.choice,
                            cut=kind == "cut")
            self.count += 1
            return [call]
        if kind == "cut":
            return [TextDelta(self.fmt.start + text, self.choice)]
        parsed = parse_calls(self.fmt, text, self.tools)
        if parsed is None:
            return [TextDelta(self.fmt.start + text + self.fmt.end, self.choice)]
        out: list[Event] = []
        for name, arguments in parsed:
            call_id = new_call_id()
            out.append(ToolCallStart(self.count, call_id, name, self.choice))
            if arguments:
                out.append(ToolCallDelta(self.count, arguments, self.choice))
            out.append(ToolCall(self.count, call_id, name, arguments, self.choice))
            self.count += 1
        return out

    def _piece(self, text: str) -> list[Event]:
        if self.fmt.native:
            return []  # parsed whole at the end
        if self._scanner is None:
            self._scanner = CallScanner()
        out: list[Event] = []
        for what, value in self._scanner.feed(text):
            if what == "start":
                self._id = new_call_id()
                out.append(ToolCallStart(self.count, self._id, value, self.choice))
            else:
                out.append(ToolCallDelta(self.count, value, self.choice))
        return out
