"""The error an API adapter turns into a 4xx/5xx in its own wire format."""

from __future__ import annotations


class ApiError(Exception):
    """A request the API refuses, or could not serve.

    Attributes:
        status: the HTTP status (400 bad field, 404 unknown model, 503 generation failed).
        message: one line for the client, naming the problem.
        param: the request field at fault (dotted path), if any.
        code: a machine-readable code (OpenAI's, e.g. ``context_length_exceeded``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def unsupported(field: str, why: str = "") -> ApiError:
    """The 400 for a request field ringlet does not support (never ignored in silence)."""
    return ApiError(400, f"unsupported field {field!r}" + (f": {why}" if why else ""), param=field,
                    code="unsupported_parameter")
