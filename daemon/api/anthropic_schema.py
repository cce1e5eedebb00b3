"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``) and their conversion to the internal
:class:`GenerationRequest`.

Unknown body fields are a 400 naming them (``extra="forbid"``). Content blocks are
checked one by one: ``text``, ``tool_use``, ``tool_result`` and ``thinking`` are
honoured; ``image``, ``document``, ``redacted_thinking`` and the server tools' blocks
are a 400 naming the block type. ``cache_control`` is accepted on every block and on the
body: the prefix cache keeps every prompt's KV without being asked. ``temperature``,
``top_p`` and ``top_k`` (which the 2.x SDK sends through ``extra_body``) are honoured.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.openai_schema import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TOOLS, tool_from
from ringlet.daemon.api.request import GenerationRequest, ResponseFormat, Tool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolDef(_Strict):
    name: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: Literal["summarized"] | None = None


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

    def conversation(self) -> list[dict[str, Any]]:
        """The messages in the Hugging Face chat-template shape (system first; each
        ``tool_result`` block a ``tool`` message, in order)."""
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else _texts(self.system or [], "system")
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _convert(m, f"messages.{i}.content")
        return out

    def tool_list(self) -> list[Tool]:
        tools = []
        for i, d in enumerate(self.tools or ()):
            if d.name is None:
                raise ApiError(400, "each tool needs a name", param=f"tools.{i}.name")
            tools.append(tool_from(d.name, d.description, d.input_schema, f"tools.{i}"))
        if len(tools) > MAX_TOOLS:
            raise ApiError(400, f"at most {MAX_TOOLS} tools are allowed", param="tools")
        if len({t.name for t in tools}) != len(tools):
            raise ApiError(400, "tool names must be unique", param="tools")
        return tools

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

    def internal(self, **sampling: Any) -> GenerationRequest:
        """The internal request (400 for a block or field that cannot be honoured)."""
        tools = self.tool_list()
        choice, parallel = self.choice(tools)
        fmt = self.output_config.format if self.output_config is not None else None
        return GenerationRequest(messages=self.conversation(), tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel, template_kwargs=self.template_kwargs(),
                                 response_format=ResponseFormat("json_schema", fmt.schema_) if fmt else None,
                                 **sampling)


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
    speed: Literal["standard"] | None = None

    def request(self) -> GenerationRequest:
        stops = list(self.stop_sequences or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES}, each of 1 to {MAX_STOP_CHARS} "
                                "characters", param="stop_sequences")
        if set(self.metadata or {}) - {"user_id"}:
            raise unsupported("metadata", "only metadata.user_id is defined")
        return self.internal(max_tokens=self.max_tokens, stop=stops, temperature=self.temperature,
                             top_p=self.top_p, top_k=self.top_k)


class CountTokensRequest(_Prompted):
    """``POST /v1/messages/count_tokens`` body."""


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    parts = []
    for block in blocks:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: only text blocks are supported here, not {block.get('type')!r}",
                           param=where)
        parts.append(block["text"])
    return "\n".join(parts)


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, where)
    return ("Error: " + text) if block.get("is_error") else text


def _convert(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, thinking = [], [], [], []
    for k, block in enumerate(message.content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.{k}"
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
                            "content": _result_text(block, here + ".content")})
        elif kind == "thinking" and message.role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
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
