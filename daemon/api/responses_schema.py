"""The request body of OpenAI's Responses API (``POST /v1/responses``) and its conversion
to the internal :class:`GenerationRequest`.

ringlet's Responses API is stateless: it keeps no responses (``store: true``,
``previous_response_id`` and ``conversation`` are refused with a 400); a client sends
the whole conversation in ``input``. As in :mod:`ringlet.daemon.api.openai_schema`,
every field ringlet does not honour is a 400 naming it, never ignored in silence;
``metadata`` and ``user`` are accepted (they carry no meaning for the generation), and
so are the bookkeeping fields of output items sent back as input (``id``, ``status``,
``annotations``...).

``reasoning.effort`` is mapped to the chat template's ``enable_thinking``: ``"none"``
and ``"minimal"`` turn thinking off, ``"low"`` and up turn it on (the levels above are
not told apart; a template without thinking ignores the variable). Reasoning summaries
are not produced: ``reasoning.summary`` is refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.openai_schema import MAX_TOOLS, choice_from, response_format_from, tool_from
from ringlet.daemon.api.request import GenerationRequest, Tool

#: content part types that carry text, and what the keys of such a part may be
TEXT_PARTS = ("input_text", "output_text")
TEXT_PART_KEYS = {"type", "text", "annotations", "logprobs", "parsed"}
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller", "parsed_arguments"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}
STATELESS = "ringlet's Responses API is stateless and keeps no responses: send the whole conversation in 'input'"


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body (checked field by field in :meth:`internal`)."""

    # strict: no coercion of wrong types; forbid: an unknown field is a 400 naming it
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def internal(self) -> GenerationRequest:
        """The internal request (400 naming the field that cannot be honoured)."""
        if self.previous_response_id is not None:
            raise unsupported("previous_response_id", STATELESS)
        if self.conversation is not None:
            raise unsupported("conversation", STATELESS)
        if self.store:
            raise unsupported("store", "ringlet keeps no responses (send store: false or leave it out)")
        if self.include:
            raise unsupported("include", "ringlet adds no optional output data (include must be empty)")
        if self.truncation == "auto":
            raise unsupported("truncation", "ringlet never drops input items; only 'disabled' is supported")
        tools = tools_from(self.tools)
        return GenerationRequest(
            messages=messages_from(self.input, self.instructions), tools=tools,
            tool_choice=tool_choice_from(self.tool_choice, tools),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=response_format_from(self.text_format(), param="text.format"),
            template_kwargs=thinking_from(self.reasoning), max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p)

    def text_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat completions' ``response_format`` (400 for other keys)."""
        if self.text is None:
            return None
        _check_keys(self.text, {"format", "verbosity"}, "text")
        if self.text.get("verbosity") is not None:
            raise unsupported("text.verbosity", "ringlet cannot steer the length of the answer")
        fmt = self.text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise ApiError(400, "text.format must be an object", param="text.format")
        if fmt.get("type") != "json_schema":
            _check_keys(fmt, {"type"}, "text.format")
            return fmt
        _check_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON Schema object", param="text.format.schema")
        spec = {"name": fmt.get("name", ""), "schema": fmt["schema"], "strict": fmt.get("strict", False)}
        return {"type": "json_schema", "json_schema": spec}


def _check_keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in obj:
        if key not in allowed:
            raise unsupported(f"{param}.{key}", "ringlet does not support it (it is never ignored in silence)")


def thinking_from(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """The template variables of ``reasoning``: ``{"enable_thinking": bool}`` for an effort."""
    if reasoning is None:
        return {}
    _check_keys(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise unsupported(f"reasoning.{key}", "ringlet returns the reasoning text itself, not a summary")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str) or effort not in EFFORT_THINKING:
        raise ApiError(400, f"reasoning.effort must be one of {', '.join(EFFORT_THINKING)}, not {effort!r}",
                       param="reasoning.effort")
    return {"enable_thinking": EFFORT_THINKING[effort]}


def tools_from(defs: list[dict[str, Any]] | None) -> list[Tool]:
    """Checked function tools (400 for another tool type, a missing name, duplicates)."""
    tools = []
    for i, d in enumerate(defs or ()):
        param = f"tools[{i}]"
        kind = d.get("type")
        if kind != "function":
            raise ApiError(400, f"{param}: tool type {kind!r} is not supported: ringlet runs no hosted tools, "
                                "only function tools ({\"type\": \"function\", \"name\": ...})",
                           param=f"{param}.type", code="unsupported_parameter")
        _check_keys(d, {"type", "name", "description", "parameters", "strict"}, param)
        if not isinstance(d.get("name"), str):
            raise ApiError(400, f"{param}.name is required: a function tool needs a name", param=f"{param}.name")
        description = d.get("description")
        if description is not None and not isinstance(description, str):
            raise ApiError(400, f"{param}.description must be a string", param=f"{param}.description")
        tools.append(tool_from(d["name"], description, d.get("parameters"), param))
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools are allowed", param="tools")
    if len({t.name for t in tools}) != len(tools):
        raise ApiError(400, "tool names must be unique", param="tools")
    return tools


def tool_choice_from(value: str | dict[str, Any] | None, tools: list[Tool]) -> str:
    """``tool_choice``: ``auto``/``none``/``required`` or ``{"type": "function", "name"}``."""
    if isinstance(value, dict):
        if value.get("type") != "function":
            raise ApiError(400, f"tool_choice type {value.get('type')!r} is not supported: only "
                                "'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
        _check_keys(value, {"type", "name"}, "tool_choice")
        value = {"type": "function", "function": {"name": value.get("name")}}
    return choice_from(value, tools)


def _text(content: Any, param: str) -> str:
    """The text of a message's ``content``: a string, or text parts (400 for others)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of content parts", param=param)
    out = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"{where}: {kind} parts are not supported: the served model reads text only",
                           param=where, code="unsupported_parameter")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}: only input_text and output_text parts are supported, not {kind!r}",
                           param=where)
        _check_keys(part, TEXT_PART_KEYS, where)
        out.append(part["text"])
    return "".join(out)


def _arguments(text: Any, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"{param}: arguments are not JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{param}: arguments must be a JSON object in a string", param=param)
    return value


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """The text of a ``reasoning`` input item: its content, else its summary."""
    _check_keys(item, REASONING_KEYS, param)
    if item.get("encrypted_content") is not None:
        raise unsupported(f"{param}.encrypted_content", "ringlet never encrypts reasoning, so it cannot read it")
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str) for p in parts):
            raise ApiError(400, f"{param}.{key} must be a list of {{\"type\": \"{kind}\", \"text\": ...}}",
                           param=f"{param}.{key}")
        texts.append("".join(p["text"] for p in parts) if key == "content" else
                     "\n\n".join(p["text"] for p in parts))
    return texts[0] or texts[1]


def messages_from(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages (Hugging Face template shape) of ``instructions`` and ``input``.

    ``function_call`` items become ``tool_calls`` of an assistant message (consecutive
    calls, and a call right after an assistant message, share one); a ``reasoning``
    item becomes the ``reasoning_content`` of the assistant turn that follows it.
    """
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    calls: set[str] = set()
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if reasoning is not None and not (kind == "function_call" or (kind == "message"
                                                                      and item.get("role") == "assistant")):
            raise ApiError(400, f"input[{i - 1}]: a reasoning item must come right before the assistant message "
                                "or function_call it belongs to", param=f"input[{i - 1}]")
        if kind == "message":
            _check_keys(item, MESSAGE_KEYS, param)
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ApiError(400, f"{param}.role must be user, assistant, system or developer, not {role!r}",
                               param=f"{param}.role")
            message = {"role": ROLES[role], "content": _text(item.get("content"), f"{param}.content")}
            if reasoning:
                message["reasoning_content"] = reasoning
            reasoning = None
            out.append(message)
        elif kind == "function_call":
            _check_keys(item, CALL_KEYS, param)
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise ApiError(400, f"{param}: a function_call needs a call_id and a name", param=param)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _arguments(item.get("arguments"), f"{param}.arguments")}}
            calls.add(call_id)
            if reasoning is None and out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"] = reasoning
                reasoning = None
                out.append(message)
        elif kind == "function_call_output":
            _check_keys(item, OUTPUT_KEYS, param)
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise ApiError(400, f"{param}: no function_call with call_id {call_id!r} comes before this "
                                    "function_call_output", param=f"{param}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"),
                                                                                  f"{param}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, param)
        else:
            raise ApiError(400, f"{param}: input item type {kind!r} is not supported: only message, function_call, "
                                "function_call_output and reasoning items", param=f"{param}.type",
                           code="unsupported_parameter")
    if reasoning is not None:
        raise ApiError(400, f"input[{len(items) - 1}]: a reasoning item must come right before the assistant "
                            "message or function_call it belongs to", param=f"input[{len(items) - 1}]")
    return out
