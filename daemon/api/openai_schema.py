"""Request bodies of OpenAI's chat completions and completions, and their conversion
to the internal :class:`GenerationRequest`.

The field policy (:mod:`ringlet.daemon.api.fields`, ``docs/api.md``): a field that
cannot change the tokens (``user``, ``metadata``, ``service_tier``,
``safety_identifier``, ``store: false``, ``prediction``, ``verbosity``...) is accepted
and named in the ``ringlet-ignored`` header; a field that would change the answer and
that ringlet cannot honour is a 400 naming it (``extra="forbid"`` for unknown fields,
and explicit checks for unsupported values). ``prompt_cache_key`` scopes the prefix
cache.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.prompting import RESERVED_TEMPLATE_KWARGS
from ringlet.daemon.api.request import MAX_N, MAX_TOP_LOGPROBS, GenerationRequest, ResponseFormat, Tool

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TOOLS = 128
#: OpenAI's rule for function names
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class _Strict(BaseModel):
    # strict: a body of the wrong types ("1" for a bool, 1.5 for an int) is a 400, never
    # coerced; forbid: an unknown field is a 400 naming it
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"only text content parts are supported, not {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message in the Hugging Face chat-template shape (arguments as objects)."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                raise ApiError(400, "only assistant messages carry tool_calls", param="messages")
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.role == "tool":
            if not self.tool_call_id:
                raise ApiError(400, "a tool message needs the tool_call_id it answers", param="messages")
            out["tool_call_id"] = self.tool_call_id
        elif self.tool_call_id is not None:
            raise ApiError(400, "only tool messages carry tool_call_id", param="messages")
        if self.name:
            out["name"] = self.name
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"a tool call's arguments are not JSON: {exc}", param="messages") from None
    if not isinstance(value, dict):
        raise ApiError(400, "a tool call's arguments must be a JSON object", param="messages")
    return value


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


def tool_from(name: str, description: str | None, parameters: Any, param: str) -> Tool:
    """A checked :class:`Tool` (400 naming ``param`` for a bad name or schema)."""
    if not FUNCTION_NAME.match(name or ""):
        raise ApiError(400, f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'", param=param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ApiError(400, f"tool {name!r}: parameters must be a JSON Schema object", param=param)
    return Tool(name, description or "", parameters)


def tools_from(defs: list[ToolDef] | None) -> list[Tool]:
    """Checked tools of an OpenAI chat request (400 for duplicates or too many)."""
    tools = [tool_from(d.function.name, d.function.description, d.function.parameters, "tools")
             for d in defs or ()]
    return checked_tools(tools)


def checked_tools(tools: list[Tool]) -> list[Tool]:
    """``tools``, after checking a request's whole list: at most :data:`MAX_TOOLS`, names
    unique (a 400 naming ``tools`` otherwise); every surface's rule."""
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools are allowed", param="tools")
    if len({t.name for t in tools}) != len(tools):
        raise ApiError(400, "tool names must be unique", param="tools")
    return tools


def choice_from(value: Any, tools: list[Tool], param: str = "tool_choice") -> str:
    """``tool_choice`` as ``auto``/``none``/``required`` or a function name (400 when it
    names no given tool, or asks for one with no tools)."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ApiError(400, f"tool_choice must be 'auto', 'none', 'required' or a function, not {value!r}",
                           param=param)
        name = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools", param=param)
    else:
        raise ApiError(400, 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                       param=param)
    if name not in ("auto", "none") and not tools:
        raise ApiError(400, f"tool_choice {name!r} needs tools", param=param)
    return name


def response_format_from(value: dict[str, Any] | None, param: str = "response_format") -> ResponseFormat | None:
    """``response_format`` checked (400 naming the problem)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema' object", param=param)
        return ResponseFormat("json_schema", spec.get("schema") or {}, str(spec.get("name", "")),
                              bool(spec.get("strict", False)))
    raise ApiError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                   param=param)


#: fields of both bodies that cannot change the tokens: accepted, named in ringlet-ignored
HINT_FIELDS = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_retention")
#: the same, of chat completions only (``store`` only when false: true is refused)
CHAT_HINT_FIELDS = ("store", "verbosity", "web_search_options")
#: ``reasoning_effort`` / ``reasoning.effort`` -> the chat template's ``enable_thinking``
EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def effort_thinking(effort: Any, param: str) -> bool:
    """Whether a reasoning effort turns the template's thinking on (400 for an unknown level).
    The levels from ``low`` up are not told apart."""
    if not isinstance(effort, str) or effort not in EFFORT_THINKING:
        raise ApiError(400, f"{param} must be one of {', '.join(EFFORT_THINKING)}, not {effort!r}", param=param)
    return EFFORT_THINKING[effort]


def tool_hints(tools: list[Tool], choice: str, strict: list[bool]) -> list[str]:
    """The tool settings that are hints for this request: ``strict`` schemas are
    enforced only when a call is forced (the grammar then allows only arguments valid
    against the schema); with ``auto`` they are not applied."""
    if not tools or choice not in ("auto", "none"):
        return []
    return ["strict"] if any(strict) else []


#: the ``stream_options`` keys honoured (the others are hints): usage in a last chunk, and
#: prompt-progress chunks during the prefill (an extension, as llama-server's ``return_progress``)
HONOURED_STREAM_OPTIONS = ("include_usage", "include_progress")


class _Common(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    return_token_ids: bool = False  # extension (as in vLLM): the completion's token ids
    return_progress: bool = False  # extension (as llama-server): prompt-progress chunks while streaming

    def hints(self) -> list[str]:
        """The accepted hints this body carries (``ringlet-ignored``)."""
        names = [f for f in HINT_FIELDS if getattr(self, f, None) is not None]
        names += [f"stream_options.{k}" for k in (self.stream_options or {}) if k not in HONOURED_STREAM_OPTIONS]
        return names

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        for s in items:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return items

    def common(self) -> dict[str, Any]:
        """The internal request's fields that both bodies share."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ApiError(400, f"logit_bias keys must be token ids, not {key!r}", param="logit_bias")
            bias[int(key)] = value
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, stop=list(self.stop or []), n=self.n, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                    logit_bias=bias, return_token_ids=self.return_token_ids, ignored=self.hints(),
                    cache_key=self.prompt_cache_key or "",
                    progress=self.stream and (self.return_progress
                                              or bool((self.stream_options or {}).get("include_progress"))))


class ChatRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    modalities: list[str] | None = None
    #: extensions (as in vLLM): the answer continues the last message (a prefill); no new
    #: assistant turn opened after the messages
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None

    def internal(self) -> GenerationRequest:
        """The internal request (400 for a field that cannot be honoured)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true (the answer "
                                "either continues the last message or opens a new turn)", param="add_generation_prompt")
        if self.store:
            raise unsupported("store", "ringlet keeps no completions")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise unsupported("modalities", "the served model writes text only")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        kwargs = dict(self.chat_template_kwargs or {})
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", effort_thinking(self.reasoning_effort, "reasoning_effort"))
        tools = tools_from(self.tools)
        choice = choice_from(self.tool_choice, tools)
        common = self.common()
        common["ignored"] += [f for f in CHAT_HINT_FIELDS if getattr(self, f) is not None]
        common["ignored"] += tool_hints(tools, choice, [bool(d.function.strict) for d in self.tools or ()])
        return GenerationRequest(
            messages=[m.for_template() for m in self.messages], tools=tools,
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format_from(self.response_format), template_kwargs=kwargs,
            max_tokens=self.max_completion_tokens or self.max_tokens, prediction=prediction_text(self.prediction),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None, prefill=self.continue_final_message,
            generation_prompt=self.add_generation_prompt is not False, **common)


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    prompt: str | list[int]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # legacy completions allow at most 5
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def internal(self) -> GenerationRequest:
        """The internal request (400 for a field that cannot be honoured)."""
        if self.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        if self.best_of not in (None, self.n):
            raise unsupported("best_of", "only best_of equal to n is supported")
        return GenerationRequest(prompt=self.prompt, echo=self.echo, max_tokens=self.max_tokens,
                                 logprobs=self.logprobs, **self.common())


def prediction_text(prediction: dict[str, Any] | None) -> str:
    """The text of a chat request's ``prediction`` (OpenAI's Predicted Outputs:
    ``{"type": "content", "content": text or [{"type": "text", "text": ...}, ...]}``),
    or "" for none.

    Raises:
        ApiError: any other shape (400 naming ``prediction``).
    """
    if prediction is None:
        return ""
    content = prediction.get("content")
    if prediction.get("type") != "content":
        raise ApiError(400, 'prediction must be {"type": "content", "content": ...}', param="prediction")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, "prediction.content must be a string or a list of text parts", param="prediction")
