"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``) and their conversion to the internal
:class:`GenerationRequest`.

The field policy (:mod:`ringlet.daemon.api.fields`, ``docs/api.md``): unknown body
fields are a 400 naming them (``extra="forbid"``). Content blocks are checked one by
one: ``text``, ``tool_use``, ``tool_result`` and ``thinking`` (whose ``signature`` must
be one ringlet sealed, :mod:`ringlet.daemon.api.seal`) are honoured; ``image``,
``document``, ``redacted_thinking`` and the server tools' blocks are a 400 naming the
block type. Accepted hints, named in ``ringlet-ignored``: ``cache_control`` on the body
and on blocks (the prefix cache keeps every prompt's KV without being asked),
``metadata.user_id``, ``service_tier``, ``speed``, ``thinking.budget_tokens``,
``output_config.effort`` (its levels are not told apart: any effort turns thinking on),
a ``context_management`` that needs no edit, server tools (left out of the prompt), and
Claude Code's ``x-anthropic-billing-header`` system block, which never reaches the
model or the cache key (it changes per request). ``temperature``, ``top_p`` and
``top_k`` (which the 2.x SDK sends through ``extra_body``) are honoured.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.openai_schema import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, checked_tools, tool_from
from ringlet.daemon.api.request import GenerationRequest, ResponseFormat, Tool
from ringlet.daemon.api.seal import Sealer, SealError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class Message(_Strict):
    """One message; ``system`` messages inside the conversation (Claude Code's
    mid-conversation beta) are rendered as system messages where they stand, and their
    ``output_config`` is a hint."""

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    output_config: dict[str, Any] | None = None


#: the system block Claude Code sends first, which varies per request (``cch=`` nonce)
BILLING_HEADER = "x-anthropic-billing-header:"
#: ``context_management.edits`` that change nothing: clearing thinking while keeping it all
NO_OP_EDITS = {("clear_thinking_20251015", "all")}


class ToolDef(_Strict):
    name: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None

    def server_tool(self) -> bool:
        """An Anthropic-defined tool (``web_search_…``, ``bash_…``, ``text_editor_…``...),
        which ringlet can neither run nor describe to the model."""
        return self.type not in (None, "custom")


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    """``thinking``: ``type`` turns the template's thinking on or off; ``display``
    ``"omitted"`` returns thinking blocks with empty text (their signature still seals
    it, so it is rendered back on the next turn)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``output_config``: ``format`` is enforced by constrained decoding; ``effort``
    turns the template's thinking on ("low" and above) — the levels are not told apart."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _Prompted(_Strict):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a hint: the prefix cache keeps every prompt anyway
    context_management: dict[str, Any] | None = None

    def conversation(self, seal: Sealer | None, ignored: list[str]) -> list[dict[str, Any]]:
        """The messages in the Hugging Face chat-template shape (system first; each
        ``tool_result`` block a ``tool`` message, in order); hints met are added to
        ``ignored``."""
        out: list[dict[str, Any]] = []
        if isinstance(self.system, str):
            system = self.system
        else:
            blocks = list(self.system or [])
            if blocks and isinstance(blocks[0], dict) and str(blocks[0].get("text", "")).startswith(BILLING_HEADER):
                blocks = blocks[1:]
                ignored.append("system.x-anthropic-billing-header")
            system = _texts(blocks, "system", ignored)
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            if m.output_config is not None:
                ignored.append("messages.output_config")
            if m.role != "system":
                out += _convert(m, f"messages.{i}.content", seal, ignored)
            elif text := (m.content if isinstance(m.content, str) else
                          _texts(m.content, f"messages.{i}.content", ignored)):
                out.append({"role": "system", "content": text})
        return out

    def context_edits(self) -> None:
        """Check ``context_management``: only edits that change nothing are accepted
        (400 naming an edit that would drop context)."""
        edits = (self.context_management or {}).get("edits", [])
        if set(self.context_management or {}) - {"edits"} or not isinstance(edits, list):
            raise unsupported("context_management", "only 'edits' is supported")
        for k, edit in enumerate(edits):
            keep = edit.get("keep", "all") if isinstance(edit, dict) else None
            kind = edit.get("type") if isinstance(edit, dict) else None
            if (kind, keep if isinstance(keep, str) else None) not in NO_OP_EDITS:
                raise unsupported(f"context_management.edits.{k}", f"edit {kind!r} would drop context, which "
                                  "ringlet does not do (clear_thinking_20251015 with keep 'all' is accepted)")

    def tool_list(self, ignored: list[str] | None = None) -> list[Tool]:
        tools = []
        for i, d in enumerate(self.tools or ()):
            if d.server_tool():
                if ignored is not None:
                    ignored.append(f"tools.{d.type}")
                continue
            if d.defer_loading:  # loaded only when a tool search finds it; ringlet runs no search
                continue
            if d.strict and ignored is not None:
                ignored.append("tools.strict")
            if d.name is None:
                raise ApiError(400, "each tool needs a name", param=f"tools.{i}.name")
            tools.append(tool_from(d.name, d.description, d.input_schema, f"tools.{i}"))
        return checked_tools(tools)

    def choice(self, tools: list[Tool]) -> tuple[str, bool]:
        """``(internal tool_choice, parallel calls allowed)``."""
        c = self.tool_choice
        if c is None:
            return "auto", True
        parallel = not c.disable_parallel_tool_use
        if c.type == "tool":
            if c.name not in {t.name for t in tools}:
                raise ApiError(400, f"tool_choice names tool {c.name!r}, which is not among the tools",
                               param="tool_choice.name")
            return c.name, parallel
        if c.type == "any" and not tools:
            raise ApiError(400, "tool_choice 'any' needs tools", param="tool_choice")
        return {"auto": "auto", "any": "required", "none": "none"}[c.type], parallel

    def template_kwargs(self) -> dict[str, Any]:
        if self.thinking is not None:
            return {"enable_thinking": self.thinking.type != "disabled"}
        if self.output_config is not None and self.output_config.effort is not None:
            return {"enable_thinking": True}
        return {}

    def hints(self) -> list[str]:
        """The body's own accepted hints (blocks add theirs in :meth:`conversation`)."""
        names = [f for f in ("cache_control", "context_management") if getattr(self, f) is not None]
        if self.thinking is not None and self.thinking.budget_tokens is not None:
            names.append("thinking.budget_tokens")
        if self.thinking is not None and self.thinking.display not in (None, "omitted"):
            names.append("thinking.display")  # summarized, updates...: the whole text is returned
        if self.output_config is not None and self.output_config.effort is not None:
            names.append("output_config.effort")
        return names

    def internal(self, seal: Sealer | None = None, **sampling: Any) -> GenerationRequest:
        """The internal request (400 for a block or field that cannot be honoured);
        ``seal`` opens the thinking blocks' signatures (``None``: no thinking block
        is accepted)."""
        self.context_edits()
        ignored = [*sampling.pop("ignored", []), *self.hints()]
        tools = self.tool_list(ignored)
        choice, parallel = self.choice(tools)
        fmt = self.output_config.format if self.output_config is not None else None
        messages = self.conversation(seal, ignored)
        kwargs = self.template_kwargs()
        prefill = self.messages[-1].role == "assistant"
        if prefill:
            self.check_prefill(messages[-1], kwargs)
        return GenerationRequest(messages=messages, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel, template_kwargs=kwargs,
                                 response_format=ResponseFormat("json_schema", fmt.schema_) if fmt else None,
                                 ignored=ignored, prefill=prefill, **sampling)

    def check_prefill(self, last: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """A final assistant message is a prefill: the answer continues its text
        (Anthropic's "prefill Claude's response"). 400 where Anthropic refuses one -- its
        text ending in whitespace, with thinking on -- or where there is nothing to continue
        (``tool_use`` blocks)."""
        where = f"messages.{len(self.messages) - 1}.content"
        if last.get("tool_calls"):
            raise ApiError(400, "a final assistant message is continued (prefill); it cannot hold tool_use "
                           "blocks", param=where)
        if (text := last.get("content", "")) != text.rstrip():
            raise ApiError(400, "final assistant content cannot end with trailing whitespace", param=where)
        if kwargs.get("enable_thinking"):
            raise ApiError(400, "a final assistant message (prefill) cannot be continued with thinking on",
                           param="thinking")


class MessagesRequest(_Prompted):
    """``POST /v1/messages`` body."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: str | None = None

    def request(self, seal: Sealer | None = None) -> GenerationRequest:
        """The internal request (400 naming a field or block that cannot be honoured)."""
        stops = list(self.stop_sequences or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES}, each of 1 to {MAX_STOP_CHARS} "
                                "characters", param="stop_sequences")
        if set(self.metadata or {}) - {"user_id"}:
            raise unsupported("metadata", "only metadata.user_id is defined")
        hints = [f for f in ("metadata", "service_tier", "speed") if getattr(self, f) is not None]
        return self.internal(seal, max_tokens=self.max_tokens, stop=stops, temperature=self.temperature,
                             top_p=self.top_p, top_k=self.top_k, ignored=hints)


class CountTokensRequest(_Prompted):
    """``POST /v1/messages/count_tokens`` body."""


def _texts(blocks: list[dict[str, Any]], where: str, ignored: list[str]) -> str:
    parts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ApiError(400, f"{where}: only text blocks are supported here, not {kind!r}", param=where)
        if "cache_control" in block:
            ignored.append("cache_control")
        parts.append(block["text"])
    return "\n".join(parts)


def _result_text(block: dict[str, Any], where: str, ignored: list[str]) -> str:
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, where, ignored)
    return ("Error: " + text) if block.get("is_error") else text


def _thinking(block: dict[str, Any], where: str, seal: Sealer | None) -> str:
    """The reasoning a ``thinking`` block holds: what its signature seals (the block's own
    text must be that, or empty as ``display: "omitted"`` returns it). 400 when the
    signature was not made by this cluster or the text was edited."""
    signature, text = block.get("signature"), block.get("thinking")
    if seal is None or not isinstance(signature, str) or not isinstance(text, str):
        raise ApiError(400, "a thinking block needs its thinking text and the signature ringlet gave it",
                       param=where + ".signature")
    try:
        sealed = seal.open("thinking", signature)
    except SealError as exc:
        raise ApiError(400, f"the thinking block's signature does not verify: {exc}",
                       param=where + ".signature") from None
    if text and text != sealed:
        raise ApiError(400, "the thinking block's text is not what its signature seals (edited thinking)",
                       param=where + ".thinking")
    return sealed


def _convert(message: Message, where: str, seal: Sealer | None, ignored: list[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, thinking = [], [], [], []
    for k, block in enumerate(message.content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.{k}"
        if isinstance(block, dict) and "cache_control" in block:
            ignored.append("cache_control")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise ApiError(400, "a tool_use block needs an id, a name and an input object", param=here)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and message.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, "a tool_result block needs the tool_use_id it answers", param=here)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block, here + ".content", ignored)})
        elif kind == "thinking" and message.role == "assistant":
            thinking.append(_thinking(block, here, seal))
        else:
            raise ApiError(400, f"content block type {kind!r} is not supported in a {message.role} message",
                           param=here + ".type")
    out: list[dict[str, Any]] = list(results)
    if texts or calls or thinking or not results:
        m: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            m["tool_calls"] = calls
        if thinking:
            m["reasoning_content"] = "\n".join(thinking)
        out.append(m)
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A generated call's arguments text as a ``tool_use`` block's ``input`` object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
