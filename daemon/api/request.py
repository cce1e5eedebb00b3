"""The one internal request and event stream every API surface converts to and from.

Each HTTP surface (OpenAI chat completions and completions, Anthropic Messages, OpenAI
Responses) is an adapter at the edge: it validates its own body, builds one
:class:`GenerationRequest`, and renders the :class:`Event` stream that
:func:`ringlet.daemon.api.pipeline.run` yields in its own wire format. The pipeline, the
node, the ring and the prefix cache see only these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: OpenAI's cap on ``top_logprobs`` (chat completions: 0..20).
MAX_TOP_LOGPROBS = 20
#: The most generations one request may ask for (``n``); each runs the whole decode.
MAX_N = 8


#: the one parameter a free-form (custom) tool is called with, as the model sees it
CUSTOM_INPUT = "input"
#: between a namespace and a function's name in the name the model sees
NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: the name the model sees and calls (``[A-Za-z0-9_-]{1,64}``, as OpenAI
            requires); a Responses ``namespace`` tool's functions are flattened to
            ``<namespace>__<name>``.
        description: what it does, for the prompt ("" when not given).
        parameters: a JSON Schema of its arguments object.
        namespace: the Responses namespace the function came in ("" for none); its calls
            go back to the client as ``name`` :attr:`client_name` in that namespace.
        custom: a Responses ``custom`` tool: free-form text input, which the model
            passes as the one string argument ``input``.
        grammar: a custom tool's Lark grammar its input must follow ("" for free text);
            enforced when the call is forced.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    namespace: str = ""
    custom: bool = False
    grammar: str = ""

    @property
    def client_name(self) -> str:
        """The name the client gave the function (within its namespace)."""
        return self.name.removeprefix(self.namespace + NAMESPACE_SEPARATOR) if self.namespace else self.name

    def as_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's ``{"type": "function", "function": {...}}`` shape, which
        Hugging Face chat templates take as ``tools``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: ``kind`` ``"json_object"`` (any JSON object) or
    ``"json_schema"`` (valid against ``schema``), enforced by constrained decoding."""

    kind: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str = ""
    strict: bool = False


@dataclass
class GenerationRequest:
    """One generation request, whatever API it came through.

    Exactly one of ``messages`` (a chat) and ``prompt`` (a raw completion) is set.

    Attributes:
        messages: chat messages in the Hugging Face chat-template shape: ``role``
            (system, user, assistant, tool), ``content`` (str), and optionally
            ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
            "arguments": dict}}]``), ``tool_call_id``, ``name``, ``reasoning_content``.
        prompt: a completion prompt: text, or token ids.
        tools: the functions the model may call.
        tool_choice: ``"auto"``, ``"none"``, ``"required"``, or the name of the one
            function that must be called. ``required`` and a name are enforced by
            constrained decoding.
        parallel_tool_calls: whether more than one call may come in one reply.
        response_format: structured output, or ``None`` for free text.
        template_kwargs: extra variables for the chat template (``enable_thinking``...).
        max_tokens: completion token cap, or ``None`` for the rest of the context.
        temperature, top_p, top_k, min_p, seed: sampling (mlx-lm's semantics).
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias: mlx-lm's
            logits processors (``logit_bias`` maps token ids to additive biases).
        stop: stop strings; the text ends before the first one found.
        n: number of generations (choices) for the same prompt.
        logprobs: ``None`` for none; k >= 0 for the chosen token's log-probability and
            the k most likely alternatives at each step.
        echo: (completions) put the prompt in front of the text.
        cache_scope: the prefix-cache scope (an API key's digest, or "").
        return_token_ids: (extension, as in vLLM) report prompt and completion token ids.
        ignored: the accepted hints the body carried (dotted field paths, tool types),
            for the ``ringlet-ignored`` header (:mod:`ringlet.daemon.api.fields`).
        progress: (extension, as llama-server's ``return_progress``) stream
            :class:`PromptProgress` events while the prompt is prefilled.
        cache_key: the client's ``prompt_cache_key``: it scopes the prefix cache as an
            API key does ("" for none).
        prediction: the text the client expects the output to be (OpenAI's Predicted
            Outputs): stage 0 drafts from it; it speeds up, never changes, the output.
        prefill: the answer continues the last message (Anthropic's prefill, vLLM's
            ``continue_final_message``): the prompt ends inside it, and the output is
            what follows its text.
        generation_prompt: open the assistant's turn after the messages (vLLM's
            ``add_generation_prompt``; never with ``prefill``).
        context_ids: token ids put before the rendered prompt (Ollama's deprecated
            ``context``: a previous ``/api/generate``'s prompt and answer).
    """

    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    cache_scope: str = ""
    return_token_ids: bool = False
    ignored: list[str] = field(default_factory=list)
    cache_key: str = ""
    progress: bool = False
    prediction: str = ""
    prefill: bool = False
    generation_prompt: bool = True
    context_ids: list[int] = field(default_factory=list)


# --- the event stream ------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token with its log-probability (natural log, of the model's
    distribution before sampling filters) and the most likely alternatives.

    Attributes:
        token: the token's text (``tokenizer.decode([id])``).
        token_id: its id.
        logprob: its log-probability.
        top: ``(text, id, logprob)`` of the most likely tokens, most likely first.
    """

    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True)
class Started:
    """The prompt is tokenized and the generation admitted.

    Attributes:
        prompt_tokens: prompt length in tokens.
        prompt_ids: the prompt's token ids.
        prompt_text: the rendered prompt (for ``echo``).
    """

    prompt_tokens: int
    prompt_ids: tuple[int, ...] = ()
    prompt_text: str = ""


@dataclass(frozen=True)
class TextDelta:
    """Visible text of choice ``choice``; ``logprobs`` cover the tokens it came from,
    and ``token_ids`` (with ``return_token_ids``: one delta per token) their ids."""

    text: str
    choice: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text of choice ``choice`` (between the model's think markers)."""

    text: str
    choice: int = 0


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call of choice ``choice`` begins: its function is known, its arguments follow
    as :class:`ToolCallDelta` events while they are generated, and :class:`ToolCall`
    completes it. Between a call's start and its completion the choice emits only that
    call's deltas.

    Attributes:
        index: its position among the choice's calls (0, 1, ...).
        id: a fresh call id (``call_...``).
        name: the function called.
    """

    index: int
    id: str
    name: str
    choice: int = 0


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the arguments text of call ``index`` of choice ``choice``; the pieces
    of a call, joined, are its :class:`ToolCall`'s ``arguments`` exactly."""

    index: int
    arguments: str
    choice: int = 0


@dataclass(frozen=True)
class ToolCall:
    """One tool call of choice ``choice``, complete (after its :class:`ToolCallStart`
    and deltas): what a non-streamed reply shows.

    Attributes:
        index: its position among the choice's calls (0, 1, ...).
        id: its id (the start's).
        name: the function called.
        arguments: its arguments: the JSON object text the model wrote, as it wrote it.
        cut: the output ended before the call did (the token cap): ``arguments`` are
            the part written.
    """

    index: int
    id: str
    name: str
    arguments: str
    choice: int = 0
    cut: bool = False


@dataclass(frozen=True)
class Finished:
    """Choice ``choice`` ended.

    Attributes:
        reason: ``"stop"`` (an end token or a stop string), ``"length"`` (the token
            cap) or ``"tool_calls"``.
        completion_tokens: tokens generated for this choice.
        token_ids: those tokens' ids.
        stop_string: the stop string that ended the text (``None``: another reason).
    """

    reason: Literal["stop", "length", "tool_calls"]
    completion_tokens: int
    choice: int = 0
    token_ids: tuple[int, ...] = ()
    stop_string: str | None = None


@dataclass(frozen=True)
class Usage:
    """The last event: token counts over all choices.

    Attributes:
        prompt_tokens: prompt length (counted once, however many choices).
        completion_tokens: generated tokens, summed over choices.
        cached_tokens: prompt tokens the prefix cache served (first choice).
        accepted_prediction_tokens, rejected_prediction_tokens: drafted tokens
            (speculative decoding: from the prompt, the output and ``prediction``) the
            model accepted and rejected, summed over choices.
        draft_trips: verifying steps around the ring, summed over choices.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    draft_trips: int = 0


@dataclass(frozen=True)
class PromptProgress:
    """Prefill progress at stage 0 (llama-server's ``prompt_progress``): ``processed``
    of ``total`` prompt tokens are in the KV cache, ``cache`` of them from the prefix
    store, ``time_ms`` milliseconds after the generation started. Only when the request
    asked for it (:attr:`GenerationRequest.progress`)."""

    total: int
    cache: int
    processed: int
    time_ms: int


@dataclass(frozen=True)
class Keepalive:
    """Nothing happened for a keepalive interval (a long prefill): the adapter sends its
    surface's keepalive (an SSE comment, Anthropic ``ping``, Responses
    ``response.in_progress``) and checks whether the client left."""


Event = (Started | PromptProgress | Keepalive | TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCall
         | Finished | Usage)
