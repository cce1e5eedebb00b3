"""Request bodies of Ollama's API (``POST /api/chat``, ``/api/generate``, ``/api/show``)
and their conversion to the internal :class:`GenerationRequest`.

The field policy (:mod:`ringlet.daemon.api.fields`, ``docs/api.md``'s Ollama sections):
unknown body fields and unknown ``options`` keys are a 400 naming them
(``extra="forbid"``); a field that cannot change the tokens (``keep_alive``, the
load-time options such as ``num_ctx``, ``num_gpu``, ``num_thread``) is accepted and named
in the ``ringlet-ignored`` header; a field that would change the answer and that ringlet
cannot honour (``images``, ``template``, ``suffix``, ``typical_p`` other than 1,
``mirostat``...) is a 400 naming it.

Options not given take Ollama's documented defaults (``temperature`` 0.8, ``top_k`` 40,
``top_p`` 0.9, no penalties), not those of ringlet's OpenAI surface, so an Ollama client
gets what Ollama would sample with.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ringlet.daemon.api.errors import ApiError, unsupported
from ringlet.daemon.api.openai_schema import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    checked_tools,
    choice_from,
    tool_from,
)
from ringlet.daemon.api.request import MAX_TOP_LOGPROBS, GenerationRequest, ResponseFormat, Tool

#: Ollama's sampling defaults (``api.DefaultOptions``) where no option says otherwise
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
#: the tokens ringlet's penalties look back over (mlx-lm's context size; engine/sampling.py)
PENALTY_WINDOW = 20
#: options that size or place the runtime (memory, threads, GPU layers): they cannot
#: change the tokens, ringlet plans these itself; accepted hints
LOAD_OPTIONS = ("num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram",
                "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only",
                "draft_num_predict", "penalize_newline")
#: sampling options ringlet does not implement, with the value that turns each off
NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
THINK_LEVELS = ("low", "medium", "high", "max")


class _Strict(BaseModel):
    # strict: wrong types are a 400, never coerced; forbid: an unknown field is a 400 naming it
    model_config = ConfigDict(extra="forbid", strict=True)


class Options(_Strict):
    """``options``: Ollama's model parameters (its Modelfile ``PARAMETER``s)."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repeat_last_n: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    num_ctx: int | None = None
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    draft_num_predict: int | None = None
    penalize_newline: bool | None = None

    def internal(self, ignored: list[str]) -> dict[str, Any]:
        """The internal request's sampling fields, cap and stop strings (Ollama's defaults
        for what is not set); adds the hints met to ``ignored``.

        Raises:
            ApiError: a sampler ringlet does not have, turned on; ``repeat_last_n`` other
                than 0 or :data:`PENALTY_WINDOW` with a penalty on; ``num_predict`` below -2
                (400 naming ``options.<key>``).
        """
        for key, off in NEUTRAL.items():
            if (value := getattr(self, key)) is not None and value != off:
                raise unsupported(f"options.{key}", f"ringlet has no such sampler; only {off} (off) is accepted")
        ignored += [f"options.{k}" for k in (*LOAD_OPTIONS, "mirostat_tau", "mirostat_eta")
                    if getattr(self, k) is not None]
        penalties = dict(repetition_penalty=self.repeat_penalty if self.repeat_penalty is not None else 1.0,
                         presence_penalty=self.presence_penalty or 0.0,
                         frequency_penalty=self.frequency_penalty or 0.0)
        penalised = penalties != {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        if self.repeat_last_n == 0:  # Ollama: 0 turns the penalties off
            penalties = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        elif self.repeat_last_n is not None and self.repeat_last_n != PENALTY_WINDOW:
            if penalised:
                raise unsupported("options.repeat_last_n", f"ringlet's penalties look at the last {PENALTY_WINDOW} "
                                  f"tokens: only {PENALTY_WINDOW} or 0 (off) is accepted with a penalty set")
            ignored.append("options.repeat_last_n")
        if self.num_predict is not None and self.num_predict < -2:
            raise ApiError(400, "options.num_predict must be a positive cap, or -1 or -2 (no cap)",
                           param="options.num_predict")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise ApiError(400, f"options.stop: at most {MAX_STOP_SEQUENCES} strings of 1 to {MAX_STOP_CHARS} "
                                "characters", param="options.stop")
        pick = {k: getattr(self, k) if getattr(self, k) is not None else v for k, v in DEFAULTS.items()}
        return dict(temperature=pick["temperature"], top_p=pick["top_p"], top_k=max(pick["top_k"], 0),
                    min_p=self.min_p or 0.0, seed=self.seed if self.seed is not None and self.seed >= 0 else None,
                    max_tokens=self.num_predict if self.num_predict and self.num_predict > 0 else None,
                    stop=stop, **penalties)


def format_from(value: str | dict[str, Any] | None) -> ResponseFormat | None:
    """``format``: ``"json"`` (any JSON object), a JSON schema object, or ``""``/absent.

    Raises:
        ApiError: any other value (400 naming ``format``).
    """
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat("json_object")
    if isinstance(value, dict):
        return ResponseFormat("json_schema", value)
    raise ApiError(400, f'format must be "json" or a JSON schema object, not {value!r}', param="format")


def think_kwargs(think: bool | str | None) -> dict[str, Any]:
    """The chat template's ``enable_thinking`` for ``think`` (a level turns it on; the
    levels are not told apart); ``{}`` when not set (the template's default).

    Raises:
        ApiError: an unknown level (400 naming ``think``).
    """
    if think is None:
        return {}
    if isinstance(think, str) and think not in THINK_LEVELS:
        raise ApiError(400, f"think must be true, false or one of {', '.join(THINK_LEVELS)}, not {think!r}",
                       param="think")
    return {"enable_thinking": bool(think)}


class _Common(_Strict):
    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: int | float | str | None = None
    think: bool | str | None = None
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @property
    def streaming(self) -> bool:
        """Ollama streams unless ``"stream": false``."""
        return self.stream is not False

    def common(self) -> dict[str, Any]:
        """The internal request's fields both bodies share (hints in ``ignored``)."""
        ignored: list[str] = []
        sampling = (self.options or Options()).internal(ignored)
        # truncate/shift true: Ollama would drop old input or shift the context; ringlet never
        # drops input (a prompt that does not fit is a 400, the output stops at the context's end)
        ignored += [f for f in ("keep_alive", "truncate", "shift") if getattr(self, f)]
        if self.top_logprobs is not None and not self.logprobs:
            ignored.append("top_logprobs")  # Ollama: applies only with logprobs
        return dict(**sampling, response_format=format_from(self.format), template_kwargs=think_kwargs(self.think),
                    logprobs=(self.top_logprobs or 0) if self.logprobs else None, ignored=ignored)


class ToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCallIn(_Strict):
    function: ToolCallFunction
    id: str | None = None


class ChatMessage(_Strict):
    """One message: ``role`` (``system``, ``user``, ``assistant``, ``tool``; any case),
    ``content``, and ``thinking``, ``tool_calls``, ``tool_name``, ``tool_call_id``."""

    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


def messages_from(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in the Hugging Face chat-template shape. Calls without an ``id`` get
    one (``call_<n>``); a tool result without ``tool_call_id`` answers the earliest
    unanswered call of its ``tool_name`` (else the earliest unanswered call).

    Raises:
        ApiError: an unknown role, images, or calls outside an assistant message (400
            naming ``messages[i]...``).
    """
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not yet answered
    for i, m in enumerate(messages):
        role = m.role.lower()
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, user, assistant or tool, not {m.role!r}",
                           param=f"messages[{i}].role")
        if m.images:
            raise unsupported(f"messages[{i}].images", "the served model reads text only (no vision model)")
        entry: dict[str, Any] = {"role": role, "content": m.content or ""}
        if m.tool_calls:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            calls = []
            for k, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{i}_{k}"
                calls.append({"id": cid, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}})
                open_calls.append((cid, c.function.name))
            entry["tool_calls"] = calls
        if role == "tool":
            cid = m.tool_call_id or next((c for c, n in open_calls if n == m.tool_name), None) or \
                (open_calls[0][0] if open_calls else f"call_{i}")
            open_calls = [(c, n) for c, n in open_calls if c != cid]
            entry["tool_call_id"] = cid
            if m.tool_name:
                entry["name"] = m.tool_name
        if m.thinking and role == "assistant":
            entry["reasoning_content"] = m.thinking
        out.append(entry)
    return out


class ToolFunction(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Strict):
    type: str = "function"
    function: ToolFunction
    items: Any = None


def tools_from(defs: list[ToolDef] | None) -> list[Tool]:
    """Checked function tools (400 for another type, a bad name or schema, duplicates)."""
    tools = []
    for i, d in enumerate(defs or ()):
        if d.type != "function":
            raise unsupported(f"tools[{i}].type", f"only function tools are supported, not {d.type!r}")
        tools.append(tool_from(d.function.name, d.function.description, d.function.parameters, "tools"))
    return checked_tools(tools)


class ChatRequest(_Common):
    """``POST /api/chat`` body. ``tool_choice`` is a ringlet extension (Ollama has none):
    OpenAI's values, ``required`` and a named function forced by a grammar."""

    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def internal(self) -> GenerationRequest:
        """The internal request (400 for a field that cannot be honoured)."""
        tools = tools_from(self.tools)
        return GenerationRequest(messages=messages_from(self.messages or []), tools=tools,
                                 tool_choice=choice_from(self.tool_choice, tools), **self.common())


class GenerateRequest(_Common):
    """``POST /api/generate`` body."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Annotated[int, Field(ge=0)]] | None = None
    raw: bool | None = None
    images: list[str] | None = None

    def internal(self) -> GenerationRequest:
        """The internal request: ``raw`` sends ``prompt`` as it is; otherwise it is a user
        message (after ``system``) in the model's chat template, after the ``context``
        token ids when given.

        Raises:
            ApiError: ``images``, ``suffix``, ``template``, or ``raw`` with ``system``,
                ``template`` or ``context`` (400 naming the field).
        """
        if self.images:
            raise unsupported("images", "the served model reads text only (no vision model)")
        if self.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        if self.raw and (self.template or self.system or self.context):
            raise ApiError(400, "raw mode does not support template, system, or context", param="raw")
        if self.template:
            raise unsupported("template", "ringlet renders the model's own (Jinja) chat template and cannot run an "
                                          "Ollama (Go) template; format the prompt yourself and send raw: true")
        common = self.common()
        if self.raw:
            return GenerationRequest(prompt=self.prompt or "", **common)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": self.prompt or ""}]
        return GenerationRequest(messages=messages, context_ids=list(self.context or ()), **common)


class ShowRequest(_Strict):
    """``POST /api/show`` body (``name`` is Ollama's older spelling of ``model``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None
