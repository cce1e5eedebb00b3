"""Drafts from a small model (``--draft-model``): speculative decoding's third drafter.

Stage 0's node loads a small model with the served model's tokenizer whole (one
:class:`~ringlet.daemon.engine.stage.Stage` of all its layers) and, for a request whose
prompt and output give no prompt-lookup or ``prediction`` draft, runs it greedily for
``k`` tokens: the drafts the ring then verifies in one trip
(:mod:`~ringlet.daemon.engine.speculation`). Greedy drafts put all their mass on one
token, the case the verification's rejection rule is exact for, so sampled requests keep
the served model's distribution too.

Each request has a :class:`DraftSession`: the draft model's own KV cache over the
request's tokens. Before drafting it keeps the longest prefix it shares with the
request's tokens so far and trims the rest (drafts the ring rejected) with mlx-lm's
``trim_prompt_cache``, then feeds what is new (a long prompt in chunks of
:data:`PREFILL_CHUNK`, each projecting only its last position), so a step costs the new tokens plus ``k``
single-token forwards of the draft model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: prompt tokens per draft-model forward while it catches up on a long prompt
PREFILL_CHUNK = 512


class DraftModelError(ValueError):
    """The draft model cannot draft for the served model (its tokenizer differs)."""


def check_tokenizers(draft: Any, served: Any, draft_name: str, served_name: str) -> None:
    """Refuse a draft model whose tokenizer differs from the served model's: its token
    ids would mean other text. Both are mlx-lm ``TokenizerWrapper`` s (or anything with
    ``get_vocab()``: token text -> id).

    Raises:
        DraftModelError: the vocabularies differ, naming how.
    """
    a, b = draft.get_vocab(), served.get_vocab()
    if a == b:
        return
    differ = sum(1 for t, i in a.items() if b.get(t) != i)
    raise DraftModelError(f"--draft-model {draft_name}: its tokenizer differs from {served_name}'s "
                          f"({len(a)} against {len(b)} tokens, {differ} with another id or missing); "
                          "a draft model must share the served model's tokenizer")


@dataclass
class DraftModel:
    """A loaded draft model.

    Args:
        stage: the whole draft model (``first`` and ``last``), whose call gives logits
            ``(1, tokens, vocab)``.
        vocab: the served model's vocabulary size: drafts are argmaxes over the first
            ``vocab`` logits only (a draft model may pad its head wider).
        name: for logs and ``/v1/cluster``.
    """

    stage: Any
    vocab: int
    name: str = ""

    def session(self) -> DraftSession:
        """A fresh per-request session (an empty KV cache)."""
        return DraftSession(self)


@dataclass
class DraftSession:
    """One request's draft-model KV cache and the token ids it holds.

    Attributes:
        fed: the token ids in :attr:`cache`, in order.
    """

    model: DraftModel
    cache: list = field(init=False)
    fed: list[int] = field(default_factory=list)
    #: leading tokens of :attr:`fed` known to equal the request's: the context given to
    #: the last :meth:`propose` (a request's tokens only grow), so a step compares only
    #: what came after it, not the whole conversation again
    _agreed: int = 0

    def __post_init__(self) -> None:
        self.cache = self.model.stage.make_cache()

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """``k`` greedy drafts to follow ``context`` (the request's prompt and output so
        far, ``len(context) >= 1``, extending the context of the previous call). Runs MLX:
        call it on the thread that runs the stage's forwards.

        Raises:
            ValueError: ``context`` is empty.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        if not context:
            raise ValueError("a draft needs at least one token of context")
        if k <= 0:
            return []
        limit = min(len(self.fed), len(context) - 1)  # the last token is fed again: its logits draft
        keep = min(self._agreed, limit)
        while keep < limit and self.fed[keep] == context[keep]:
            keep += 1
        if keep < len(self.fed):
            trim_prompt_cache(self.cache, len(self.fed) - keep)
            del self.fed[keep:]
        self._agreed = keep
        pending = [int(t) for t in context[keep:]]
        while len(pending) > PREFILL_CHUNK:  # catch up on a long prompt without the head
            piece, pending = pending[:PREFILL_CHUNK], pending[PREFILL_CHUNK:]
            mx.eval(self.model.stage(mx.array([piece]), self.cache, head=True))
            self.fed += piece
        drafts: list[int] = []
        for _ in range(k):
            logits = self.model.stage(mx.array([pending]), self.cache, head=True)
            token = int(mx.argmax(logits[0, -1, : self.model.vocab]).item())
            self.fed += pending
            drafts.append(token)
            pending = [token]
        self._agreed = len(context)
        return drafts
