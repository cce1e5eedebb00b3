"""An API error in the wire format of the surface a path belongs to (OpenAI, Anthropic, Ollama)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ringlet.daemon.wire.limits import is_ollama

__all__ = ["ANTHROPIC_PATHS", "error_response"]

#: paths whose errors take Anthropic's shape
ANTHROPIC_PATHS = ("/v1/messages",)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
           path: str = "") -> JSONResponse:
    """``status`` with ``message`` as the surface of ``path`` writes errors: Ollama's
    ``{"error": "..."}``, Anthropic's ``{"type": "error", "error": {...}}``, else OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``."""
    if is_ollama(path):  # Ollama's errors are {"error": "..."}: the message names the field
        if param and param not in message:
            message = f"{param}: {message}"
        return JSONResponse(status_code=status, content={"error": message})
    if path.startswith(ANTHROPIC_PATHS):
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}.get(status, "api_error")
        if param and param not in message:  # Anthropic's errors have no param: the message names it
            message = f"{param}: {message}"
        return JSONResponse(status_code=status, content={"type": "error", "error": {"type": kind, "message": message}})
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})
