"""docs/api.md is the field policy's table: every top-level field each surface's schema
accepts is listed in that surface's section (Ollama's also its message fields and its
``options`` keys), so a field cannot be added (honoured, hint or refused by value) without
the table saying what ringlet does with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringlet.daemon.api import ollama_schema
from ringlet.daemon.api.anthropic_schema import MessagesRequest
from ringlet.daemon.api.openai_schema import ChatRequest, CompletionRequest
from ringlet.daemon.api.responses_schema import ResponsesRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def section(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize(("heading", "schema"), [
    ("## OpenAI chat completions", ChatRequest), ("## OpenAI completions", CompletionRequest),
    ("## Anthropic messages", MessagesRequest), ("## OpenAI Responses", ResponsesRequest),
    ("## Ollama chat", ollama_schema.ChatRequest), ("## Ollama chat", ollama_schema.ChatMessage),
    ("## Ollama generate", ollama_schema.GenerateRequest), ("## Ollama options", ollama_schema.Options),
    ("## Ollama's other endpoints", ollama_schema.ShowRequest)])
def test_every_accepted_field_is_in_its_surfaces_table(heading, schema):
    listed = set(re.findall(r"`([a-z_][a-z0-9_]*)", section(heading)))
    fields = {info.alias or name for name, info in schema.model_fields.items()}
    assert fields - listed == set(), f"{heading}: fields missing from docs/api.md"
