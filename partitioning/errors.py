"""Errors raised by the planner.

Both are :class:`ValueError` subclasses, so a caller that only wants "the inputs
cannot produce a plan" can catch ``ValueError``; a caller that wants to explain
why (the daemon, the CLI) catches the specific class and reads its fields.
"""

from __future__ import annotations


class Infeasible(ValueError):
    """The model does not fit in the memory of the usable nodes.

    Attributes:
        shortfall_bytes: the fewest bytes that do not fit, over every ring order
            the planner considered and every contiguous split (so adding this
            much memory, where the split needs it, makes the plan feasible).
            For a cluster with no usable node it is the whole model's memory.
        max_context_tokens: the largest context (KV cache length, tokens) at
            which the model would fit; 0 when even the weights alone do not fit.
        required_bytes: memory the model needs at the requested context
            (weights + embedding + head + KV cache), counted once.
        available_bytes: total usable memory of the usable nodes.
        message: a one-line, human explanation (also ``str(error)``).
    """

    def __init__(
        self,
        message: str,
        *,
        shortfall_bytes: int,
        max_context_tokens: int,
        required_bytes: int,
        available_bytes: int,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.shortfall_bytes = int(shortfall_bytes)
        self.max_context_tokens = int(max_context_tokens)
        self.required_bytes = int(required_bytes)
        self.available_bytes = int(available_bytes)

    def to_dict(self) -> dict:
        """The error as a JSON-safe dict (``{"error": "infeasible", ...}``)."""
        return {
            "error": "infeasible",
            "message": self.message,
            "shortfall_bytes": self.shortfall_bytes,
            "max_context_tokens": self.max_context_tokens,
            "required_bytes": self.required_bytes,
            "available_bytes": self.available_bytes,
        }


class InvalidPlan(ValueError):
    """A plan (usually received from a peer) is malformed: a gap, an overlap, an
    empty stage, an unknown node, a range outside the model, or a ``plan_id``
    that does not match the content. The message names the first problem."""
