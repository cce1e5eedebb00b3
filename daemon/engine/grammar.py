"""Grammar-constrained decoding on the last stage, with llguidance.

A request's grammar travels with its sampling parameters as llguidance's grammar text
(a serialized JSON grammar, from :func:`json_schema_grammar` or :func:`lark_grammar`).
The stage that samples builds one :class:`Constraint` per request; before each draw it
masks out every token the grammar forbids, and after it feeds the drawn token in. When
the grammar is complete only the end-of-sequence tokens remain allowed, so the output
is always a full sentence of the grammar, or is cut by ``max_tokens``.

Why llguidance (over xgrammar and outlines-core): it builds a mask in tens of
microseconds without precomputing per-state tables, so a new JSON schema per request
costs nothing up front; it takes JSON Schema and Lark (with JSON Schema embedded) in
one grammar format; it ships abi3 wheels for Linux x86-64/arm64 and macOS; and it is
what vLLM, SGLang and llama.cpp use for the same job.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from ringlet.daemon.errors import RingletError


class GrammarError(RingletError):
    """A grammar or JSON schema llguidance cannot compile; the message says why."""


_tokenizers: dict[tuple[int, int], Any] = {}
_lock = threading.Lock()


def ll_tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face fast tokenizer (built once per process and
    tokenizer: it takes about 0.5 s).

    Args:
        hf_tokenizer: a ``transformers.PreTrainedTokenizerFast``.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
    """
    import llguidance.hf

    with _lock:
        key = (id(hf_tokenizer), vocab_size)
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        return _tokenizers[key]


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text valid against ``schema`` (a JSON Schema object).

    Raises:
        GrammarError: llguidance cannot compile the schema (the message names why).
    """
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except Exception as exc:  # it raises ValueError / RuntimeError with the reason
        raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
    return check(grammar)


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: ``%json {schema}`` embeds a
    JSON Schema).

    Raises:
        GrammarError: the grammar does not compile.
    """
    import llguidance

    return check(llguidance.LLMatcher.grammar_from_lark(lark))


def check(grammar: str) -> str:
    """``grammar`` itself, once llguidance has validated it.

    Raises:
        GrammarError: it does not compile.
    """
    import llguidance

    ok, error = _validate(llguidance, grammar)
    if not ok:
        raise GrammarError(f"the grammar cannot be compiled: {error}")
    return grammar


def _validate(llguidance, grammar: str) -> tuple[bool, str]:
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:
        return False, str(exc)
    return (not is_error), "; ".join(messages)


def tool_call_lark(calls: list[tuple[str, dict[str, Any]]], start: str, end: str, many: bool) -> str:
    """A Lark grammar for tool calls: ``start {"name": ..., "arguments": {...}} end``,
    once (or one or more times when ``many``), where the name is one of ``calls`` and
    the arguments valid against that function's parameters schema.

    Args:
        calls: ``(function name, parameters JSON Schema)`` pairs.
        start, end: the text around each call (e.g. ``<tool_call>`` and ``</tool_call>``).
        many: allow several calls in a row (``parallel_tool_calls``).
    """
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": name}, "arguments": params}} for name, params in calls]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = json.dumps(schema)
    repeat = "+" if many else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(start)} json_call {json.dumps(end)}\n"
            f"json_call: %json {body}\n")


def regex_lark(regex: str) -> str:
    """A Lark grammar whose sentences are the matches of ``regex`` (a regular expression
    in the Rust ``regex`` dialect llguidance uses)."""
    return "start: /" + regex.replace("/", "\\/") + "/\n"


def custom_call_grammar(name: str, lark: str, start: str, end: str) -> str:
    """The grammar of one free-form tool call written raw: ``start`` ``name`` newline,
    then a sentence of the tool's own Lark grammar ``lark``, then ``end``. The tool's
    grammar is a separate grammar referenced by ``@custom_input`` (llguidance's nested
    grammars), so its rule names cannot clash with the frame's.

    Raises:
        GrammarError: the tool's grammar does not compile.
    """
    frame = f"start: {json.dumps(start + name + chr(10))} @custom_input {json.dumps(end)}\n"
    return check(json.dumps({"grammars": [{"lark_grammar": frame},
                                          {"name": "custom_input", "lark_grammar": lark}]}))


class Constraint:
    """One request's grammar state on the sampling stage.

    Args:
        grammar: llguidance grammar text (from this module's builders).
        tokenizer: :func:`ll_tokenizer`'s result.
        vocab_size: logits width.
    Raises:
        GrammarError: the grammar does not compile.
    """

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        import llguidance

        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {self._matcher.get_error()}")
        self._vocab = vocab_size
        self._bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A boolean mask ``(vocab_size,)`` of the tokens the grammar allows next."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        return bits.astype(bool)

    def consume(self, token: int) -> None:
        """Feed the drawn token in (a token the mask forbade puts the matcher in error;
        the next :meth:`allowed` then allows only end-of-sequence)."""
        self._matcher.consume_token(int(token))

    def replay(self, tokens: list[int]) -> None:
        """Feed tokens drawn earlier (a request resumed on a new plan)."""
        for t in tokens:
            self._matcher.consume_token(int(t))
