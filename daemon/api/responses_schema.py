"""The request body of OpenAI's Responses API (``POST /v1/responses``) and its conversion
to the internal :class:`GenerationRequest`.

ringlet's Responses API is stateless: it keeps no responses (``store: true``,
``previous_response_id`` and ``conversation`` are refused with a 400); a client sends
the whole conversation in ``input``. The field policy (:mod:`ringlet.daemon.api.fields`,
``docs/api.md``): a field that cannot change the tokens is accepted and named in the
``ringlet-ignored`` header (``metadata``, ``user``, ``client_metadata``,
``safety_identifier``, ``service_tier``, ``store: false``, ``stream_options``,
``reasoning.summary``, ``text.verbosity``, hosted tools such as ``web_search``, which
ringlet leaves out of the prompt...); the bookkeeping fields of output items sent back
as input (``id``, ``status``, ``annotations``...) are accepted as they are; any other
unknown field is a 400 naming it. ``prompt_cache_key`` scopes the prefix cache.

Tools: ``function`` tools; ``namespace`` tools, flattened into functions named
``<namespace>__<name>`` (calls go back with their namespace and name); ``custom``
(free-form) tools, whose Lark grammar is enforced by the grammar engine when the call is
forced. ``include: ["reasoning.encrypted_content"]`` makes reasoning items carry their
text sealed with the cluster's key (:mod:`ringlet.daemon.api.seal`); a reasoning item
sent back is opened and rendered as generated.

``reasoning.effort`` is mapped to the chat template's ``enable_thinking``: ``"none"``
and ``"minimal"`` turn thinking off, ``"low"`` and up turn it on (the levels above are
not told apart; a template without thinking ignores the variable).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.openai_schema import (
    FUNCTION_NAME,
    checked_tools,
    choice_from,
    effort_thinking,
    response_format_from,
    tool_from,
    tool_hints,
)
from ringlet.daemon.api.request import CUSTOM_INPUT, NAMESPACE_SEPARATOR, GenerationRequest, Tool
from ringlet.daemon.api.seal import Sealer, SealError
from ringlet.daemon.engine import grammar as grammars

#: content part types that carry text, and what the keys of such a part may be
TEXT_PARTS = ("input_text", "output_text")
TEXT_PART_KEYS = {"type", "text", "annotations", "logprobs", "parsed"}
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller", "parsed_arguments"}
CUSTOM_CALL_KEYS = {"type", "call_id", "name", "input", "id", "status", "namespace"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
STATELESS = "ringlet's Responses API is stateless and keeps no responses: send the whole conversation in 'input'"
#: tools OpenAI runs on its side; ringlet cannot, so they are left out of the prompt
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "computer_use", "computer_use_preview", "computer", "mcp",
                "image_generation", "local_shell", "shell", "apply_patch", "tool_search")
#: ``include`` values ringlet honours; the others ask for data of hosted tools or logprobs (hints)
INCLUDE_HONOURED = ("reasoning.encrypted_content",)
#: top-level fields that cannot change the tokens
HINT_FIELDS = ("metadata", "user", "client_metadata", "safety_identifier", "service_tier",
               "prompt_cache_retention", "stream_options")


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
    client_metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None

    def internal(self, seal: Sealer | None = None) -> GenerationRequest:
        """The internal request (400 naming the field that cannot be honoured); ``seal``
        opens reasoning items' ``encrypted_content``."""
        if self.previous_response_id is not None:
            raise unsupported("previous_response_id", STATELESS)
        if self.conversation is not None:
            raise unsupported("conversation", STATELESS)
        if self.store:
            raise unsupported("store", "ringlet keeps no responses (send store: false or leave it out)")
        if self.background:
            raise unsupported("background", "ringlet runs no background responses: " + STATELESS)
        if self.truncation == "auto":
            raise unsupported("truncation", "ringlet never drops input items; only 'disabled' is supported")
        ignored = [f for f in HINT_FIELDS if getattr(self, f) is not None]
        if self.store is False:
            ignored.append("store")
        ignored += [f"include.{v}" for v in self.include or () if v not in INCLUDE_HONOURED]
        tools = tools_from(self.tools, ignored)
        choice = tool_choice_from(self.tool_choice, tools)
        ignored += tool_hints(tools, choice, [bool(d.get("strict")) for d in self.tools or ()
                                              if d.get("type") == "function"])
        return GenerationRequest(
            messages=messages_from(self.input, self.instructions, tools, seal), tools=tools,
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=response_format_from(self.text_format(ignored), param="text.format"),
            template_kwargs=thinking_from(self.reasoning, ignored), max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, ignored=ignored,
            cache_key=self.prompt_cache_key or "")

    def sealed_reasoning(self) -> bool:
        """Whether reasoning items carry ``encrypted_content`` (``include`` asks for it)."""
        return "reasoning.encrypted_content" in (self.include or ())

    def text_format(self, ignored: list[str]) -> dict[str, Any] | None:
        """``text.format`` as chat completions' ``response_format`` (400 for other keys)."""
        if self.text is None:
            return None
        _check_keys(self.text, {"format", "verbosity"}, "text")
        if self.text.get("verbosity") is not None:
            ignored.append("text.verbosity")
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


def thinking_from(reasoning: dict[str, Any] | None, ignored: list[str]) -> dict[str, Any]:
    """The template variables of ``reasoning``: ``{"enable_thinking": bool}`` for an
    effort; ``summary`` and ``generate_summary`` are hints (ringlet returns the reasoning
    text itself, never a summary)."""
    if reasoning is None:
        return {}
    _check_keys(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    ignored += [f"reasoning.{k}" for k in ("summary", "generate_summary") if reasoning.get(k) is not None]
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    return {"enable_thinking": effort_thinking(effort, "reasoning.effort")}


def _function(d: dict[str, Any], param: str, namespace: str = "") -> Tool:
    """A checked function tool (400 for a missing name or bad fields)."""
    _check_keys(d, {"type", "name", "description", "parameters", "strict", "defer_loading"}, param)
    if not isinstance(d.get("name"), str):
        raise ApiError(400, f"{param}.name is required: a function tool needs a name", param=f"{param}.name")
    description = d.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{param}.description must be a string", param=f"{param}.description")
    name = f"{namespace}{NAMESPACE_SEPARATOR}{d['name']}" if namespace else d["name"]
    tool = tool_from(name, description, d.get("parameters"), param)
    return replace(tool, namespace=namespace)


def _custom(d: dict[str, Any], param: str) -> Tool:
    """A checked custom (free-form) tool: its input is text, following the Lark grammar
    of ``format`` when it has one (400 for a grammar that does not compile)."""
    _check_keys(d, {"type", "name", "description", "format"}, param)
    fmt = d.get("format") or {"type": "text"}
    grammar = ""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise ApiError(400, f"{param}.format must be {{\"type\": \"text\"}} or a grammar", param=f"{param}.format")
    if fmt["type"] == "grammar":
        _check_keys(fmt, {"type", "syntax", "definition"}, f"{param}.format")
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str) or not definition:
            raise ApiError(400, f"{param}.format needs syntax 'lark' or 'regex' and a definition",
                           param=f"{param}.format")
        grammar = definition if syntax == "lark" else grammars.regex_lark(definition)
        try:
            grammars.lark_grammar(grammar)
        except grammars.GrammarError as exc:
            raise ApiError(400, f"{param}.format: {exc}", param=f"{param}.format.definition") from None
    description = str(d.get("description") or "")
    if grammar:
        description += f"\nIts input follows this grammar ({fmt.get('syntax')}):\n{fmt.get('definition')}"
    params = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}}, "required": [CUSTOM_INPUT],
              "additionalProperties": False}
    return replace(tool_from(d.get("name"), description.strip(), params, param), custom=True, grammar=grammar)


def tools_from(defs: list[dict[str, Any]] | None, ignored: list[str] | None = None) -> list[Tool]:
    """Checked tools: functions, namespaces' functions (flattened) and custom tools;
    hosted tools are left out and added to ``ignored`` (400 for an unknown type, a
    missing name, duplicates)."""
    tools = []
    for i, d in enumerate(defs or ()):
        param = f"tools[{i}]"
        kind = d.get("type")
        if kind == "function":
            tools.append(_function(d, param))
        elif kind == "namespace":
            _check_keys(d, {"type", "name", "description", "tools"}, param)
            space = d.get("name")
            if not isinstance(space, str) or not FUNCTION_NAME.match(space) or not isinstance(d.get("tools"), list):
                raise ApiError(400, f"{param}: a namespace needs a name and a list of tools", param=param)
            for j, inner in enumerate(d["tools"]):
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise ApiError(400, f"{param}.tools[{j}]: a namespace holds function tools only",
                                   param=f"{param}.tools[{j}].type")
                tools.append(_function(inner, f"{param}.tools[{j}]", space))
        elif kind == "custom":
            tools.append(_custom(d, param))
        elif kind in HOSTED_TOOLS:
            if ignored is not None:
                ignored.append(f"tools.{kind}")
        else:
            raise ApiError(400, f"{param}: tool type {kind!r} is not supported: ringlet takes function, namespace "
                                "and custom tools (hosted tools are left out)", param=f"{param}.type",
                           code="unsupported_parameter")
    return checked_tools(tools)


def tool_choice_from(value: str | dict[str, Any] | None, tools: list[Tool]) -> str:
    """``tool_choice``: ``auto``/``none``/``required``, ``{"type": "function", "name"}``
    (with its ``namespace``, if any) or ``{"type": "custom", "name"}``."""
    if isinstance(value, dict):
        if value.get("type") not in ("function", "custom"):
            raise ApiError(400, f"tool_choice type {value.get('type')!r} is not supported: only "
                                "'auto', 'none', 'required' or {\"type\": \"function\" | \"custom\", \"name\": ...}",
                           param="tool_choice")
        _check_keys(value, {"type", "name", "namespace"}, "tool_choice")
        name = value.get("name")
        if value.get("namespace") and isinstance(name, str):
            name = f"{value['namespace']}{NAMESPACE_SEPARATOR}{name}"
        value = {"type": "function", "function": {"name": name}}
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


def _reasoning_text(item: dict[str, Any], param: str, seal: Sealer | None) -> str:
    """The text of a ``reasoning`` input item: what its ``encrypted_content`` seals (400
    when this cluster did not seal it), else its content, else its summary."""
    _check_keys(item, REASONING_KEYS, param)
    if item.get("encrypted_content") is not None:
        sealed = item["encrypted_content"]
        if seal is None or not isinstance(sealed, str):
            raise ApiError(400, f"{param}.encrypted_content must be a string ringlet sealed",
                           param=f"{param}.encrypted_content")
        try:
            return seal.open("reasoning", sealed)
        except SealError as exc:
            raise ApiError(400, f"{param}.encrypted_content does not open: {exc}",
                           param=f"{param}.encrypted_content") from None
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


def _call_name(item: dict[str, Any], param: str) -> str:
    """The name the model saw for a call item (namespaced functions flattened)."""
    name, space = item.get("name"), item.get("namespace")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{param}: a call needs a call_id and a name", param=param)
    return f"{space}{NAMESPACE_SEPARATOR}{name}" if isinstance(space, str) and space else name


def messages_from(items: str | list[dict[str, Any]], instructions: str | None, tools: list[Tool] | None = None,
                  seal: Sealer | None = None) -> list[dict[str, Any]]:
    """The chat messages (Hugging Face template shape) of ``instructions`` and ``input``.

    ``function_call`` and ``custom_tool_call`` items become ``tool_calls`` of an
    assistant message (consecutive calls, and a call right after an assistant message,
    share one; a custom call's input is its one argument ``input``); their outputs
    become ``tool`` messages; a ``reasoning`` item becomes the ``reasoning_content`` of
    the assistant turn that follows it.
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
        if reasoning is not None and not (kind in ("function_call", "custom_tool_call") or (
                kind == "message" and item.get("role") == "assistant")):
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
        elif kind in ("function_call", "custom_tool_call"):
            _check_keys(item, CALL_KEYS if kind == "function_call" else CUSTOM_CALL_KEYS, param)
            call_id, name = item.get("call_id"), _call_name(item, param)
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(400, f"{param}: a call needs a call_id and a name", param=param)
            if kind == "function_call":
                arguments = _arguments(item.get("arguments"), f"{param}.arguments")
            elif isinstance(item.get("input"), str):
                arguments = {CUSTOM_INPUT: item["input"]}
            else:
                raise ApiError(400, f"{param}.input must be a string", param=f"{param}.input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            calls.add(call_id)
            if reasoning is None and out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"] = reasoning
                reasoning = None
                out.append(message)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _check_keys(item, OUTPUT_KEYS, param)
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise ApiError(400, f"{param}: no function_call with call_id {call_id!r} comes before this "
                                    "function_call_output", param=f"{param}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"),
                                                                                  f"{param}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, param, seal)
        else:
            raise ApiError(400, f"{param}: input item type {kind!r} is not supported: only message, function_call, "
                                "custom_tool_call, their outputs and reasoning items", param=f"{param}.type",
                           code="unsupported_parameter")
    if reasoning is not None:
        raise ApiError(400, f"input[{len(items) - 1}]: a reasoning item must come right before the assistant "
                            "message or function_call it belongs to", param=f"input[{len(items) - 1}]")
    return out
