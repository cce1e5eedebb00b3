"""``ringlet chat``: a small streaming client of any node's OpenAI-compatible API."""

from __future__ import annotations

import json
import sys

import httpx

from ringlet.daemon.errors import RingletError


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <key>`` when there is a key, else nothing."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def stream_chat(api: str, messages: list[dict], max_tokens: int, temperature: float, api_key: str | None = None,
                model: str | None = None):
    """Yield text deltas of a streamed chat completion from ``api`` (base URL), sending
    ``api_key`` as a bearer key when given, to ``model`` (``None``: the node's first).

    Raises:
        RingletError: the node is unreachable or answered with an error.
    """
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    if model:
        body["model"] = model
    try:
        with httpx.stream("POST", f"{api.rstrip('/')}/v1/chat/completions", json=body, timeout=300,
                          headers=auth_headers(api_key)) as resp:
            if resp.status_code != 200:
                resp.read()
                try:
                    message = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = resp.text[:200]
                raise RingletError(f"{api} answered {resp.status_code}: {message}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RingletError(event["error"]["message"])
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        yield text
    except httpx.HTTPError as exc:
        raise RingletError(f"cannot reach {api}: {exc}") from None


def chat_loop(api: str, message: str | None, max_tokens: int, temperature: float, api_key: str | None = None,
              model: str | None = None) -> int:
    """One message, or an interactive session (empty line or Ctrl-D ends it)."""
    history: list[dict] = []
    while True:
        if message is None:
            try:
                text = input("> ").strip()
            except EOFError:
                return 0
            if not text:
                return 0
        else:
            text = message
        history.append({"role": "user", "content": text})
        reply = []
        for delta in stream_chat(api, history, max_tokens, temperature, api_key, model):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        if message is not None:
            return 0
