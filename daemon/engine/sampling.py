"""Token sampling on the last stage: logits processors, grammar, filters, a seeded draw.

Per step, in mlx-lm's order (``mlx_lm.generate.generate_step``, ``make_sampler``):

1. the logits processors of ``mlx_lm.sample_utils.make_logits_processors``: logit
   bias, then repetition, presence and frequency penalties over the last 20 tokens
   of prompt + completion (mlx-lm's default context sizes);
2. the request's grammar (:mod:`ringlet.daemon.engine.grammar`): forbidden tokens
   get ``-inf``;
3. the filters top-p, min-p, top-k (mlx-lm's ``apply_top_p``, ``apply_min_p``,
   ``apply_top_k``), then ``mx.random.categorical`` with an explicit per-request key,
   split once per token, so a seeded request samples the same tokens whatever else
   the node is serving; temperature 0 is the argmax.

Log-probabilities (``logprobs``) are those of the model's own distribution, the log
softmax of the raw logits (in float64), before any processor, grammar or filter, as in
OpenAI's API and vLLM's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request.

    Attributes:
        temperature: 0 means greedy (argmax of the logits); must be in [0, 2].
        top_p: nucleus mass in (0, 1]; 0 or 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds this request's random key; ``None`` draws one from the node's RNG.
        steps_done: tokens already sampled for this request elsewhere (a request
            resumed on a new plan): the key skips ahead so a seeded stream continues
            as it would have, and the grammar replays those tokens.
        min_p: min-p filter in [0, 1); 0 disables it.
        presence_penalty, frequency_penalty: additive penalties in [-2, 2]; 0 disables.
        repetition_penalty: multiplicative penalty > 0; 1 disables it.
        logit_bias: ``(token id, additive bias)`` pairs.
        logprobs: -1 for none; k >= 0 reports each token's log-probability and the k
            most likely alternatives.
        grammar: llguidance grammar text the tokens must follow; "" for none.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    steps_done: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int = -1
    grammar: str = ""


class Token(int):
    """A sampled token id, with its scores when the request asked for logprobs.

    An ``int`` subclass, so every path that moves token ids moves these unchanged.

    Attributes:
        logprob: natural-log probability of this token (``None`` when not asked).
        top: ``(token id, logprob)`` of the most likely tokens, most likely first.
    """

    logprob: float | None
    top: tuple[tuple[int, float], ...]

    def __new__(cls, value: int, logprob: float | None = None, top: tuple[tuple[int, float], ...] = ()):
        token = super().__new__(cls, value)
        token.logprob, token.top = logprob, top
        return token


#: Supplies llguidance's tokenizer for a logits width (built lazily, once per process).
GrammarTokenizer = Callable[[int], object]


class RequestSampler:
    """Samples one request's tokens from last-stage logits ``(vocab,)``.

    Args:
        params: the request's sampling parameters.
        grammar_tokenizer: the llguidance tokenizer supplier; needed when
            ``params.grammar`` is set.
    Raises:
        GrammarError: the grammar does not compile, or no tokenizer was supplied.
    """

    def __init__(self, params: SamplingParams, grammar_tokenizer: GrammarTokenizer | None = None):
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

        self.params = params
        self._greedy = params.temperature == 0
        self._filters = []
        if 0 < params.top_p < 1:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if 0 < params.min_p < 1:
            self._filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k > 0:
            # top_k >= vocabulary keeps everything; mlx-lm raises on it inside compiled code,
            # which leaves MLX's random state broken for every later request of the process
            self._filters.append(lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x)
        self._processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            presence_penalty=params.presence_penalty or None,
            frequency_penalty=params.frequency_penalty or None)
        self._constraint = None
        if params.grammar and grammar_tokenizer is None:
            from ringlet.daemon.engine.grammar import GrammarError

            raise GrammarError("this stage cannot apply a grammar: it has no tokenizer")
        self._grammar_tokenizer = grammar_tokenizer
        seed = params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        self._key = mx.random.key(seed)
        for _ in range(params.steps_done):
            self._key, _ = mx.random.split(self._key)

    def __call__(self, logits: mx.array, history: Sequence[int] = ()) -> Token:
        """Pick the next token id from float logits of shape ``(vocab,)``.

        ``history`` is the request's tokens so far (prompt, then completion), for the
        penalties and, on a resumed request's first step, the grammar's replay of the
        ``steps_done`` tokens drawn before the resume."""
        logits = logits.astype(mx.float32)[None]
        raw = logits[0] if self.params.logprobs >= 0 else None
        if self._processors:
            tokens = mx.array(list(history), dtype=mx.int32)
            for process in self._processors:
                logits = process(tokens, logits)
        if self.params.grammar:
            if self._constraint is None:  # the first step: build it, and replay a resumed request's tokens
                from ringlet.daemon.engine.grammar import Constraint

                width = logits.shape[-1]
                self._constraint = Constraint(self.params.grammar, self._grammar_tokenizer(width), width)
                if self.params.steps_done:
                    self._constraint.replay(list(history)[-self.params.steps_done:])
            allowed = mx.array(self._constraint.allowed()[: logits.shape[-1]])
            logits = mx.where(allowed[None], logits, mx.array(-mx.inf, dtype=logits.dtype))
        if self._greedy:
            token = int(mx.argmax(logits, axis=-1)[0].item())
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            for keep in self._filters:
                logprobs = keep(logprobs)
            self._key, draw = mx.random.split(self._key)
            token = int(mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=draw)[0].item())
        if self._constraint is not None:
            self._constraint.consume(token)
        if raw is None:
            return Token(token)
        return Token(token, *top_logprobs(raw, token, self.params.logprobs))


def top_logprobs(logits: mx.array, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``(logprob of token, k most likely (id, logprob), most likely first)`` from raw
    logits ``(vocab,)``. The log softmax is taken in float64 with numpy: MLX's float32
    ``logsumexp`` over a 49k vocabulary is off by ~1e-4 on this CPU."""
    x = np.asarray(logits, dtype=np.float64)
    top = float(x.max())
    scores = x - (top + np.log(np.exp(x - top).sum()))
    chosen = float(scores[token])
    if k <= 0:
        return chosen, ()
    ids = np.argpartition(-scores, k - 1)[:k]
    ids = ids[np.argsort(-scores[ids], kind="stable")]
    return chosen, tuple((int(i), float(scores[i])) for i in ids)


def sampling_to_dict(params: SamplingParams) -> dict:
    """Sampling parameters as a JSON-able dict (a tensor group's control channel)."""
    out = asdict(params)
    out["logit_bias"] = [list(pair) for pair in params.logit_bias]
    return out


def sampling_from_dict(values: dict, steps_done: int | None = None) -> SamplingParams:
    """:func:`sampling_to_dict`'s inverse; ``steps_done`` overrides the stored count."""
    known = {f.name for f in fields(SamplingParams)}
    kwargs = {k: v for k, v in values.items() if k in known}
    kwargs["logit_bias"] = tuple((int(t), float(b)) for t, b in values.get("logit_bias", ()))
    if steps_done is not None:
        kwargs["steps_done"] = steps_done
    return SamplingParams(**kwargs)
