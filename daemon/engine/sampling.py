"""Token sampling on the last stage: greedy, temperature, top-p, top-k, seeded.

The filters are mlx-lm's (``apply_top_p``, ``apply_top_k`` from
``mlx_lm.sample_utils``, in the order ``make_sampler`` chains them); the final draw
is ``mx.random.categorical`` with an explicit per-request key, split once per token,
so a seeded request samples the same tokens whatever else the node is serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


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
            as it would have.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    steps_done: int = 0


class RequestSampler:
    """Samples one request's tokens from last-stage logits ``(vocab,)``."""

    def __init__(self, params: SamplingParams):
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        self.params = params
        self._greedy = params.temperature == 0
        self._filters = []
        if 0 < params.top_p < 1:
            self._filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.top_k > 0:
            # top_k >= vocabulary keeps everything; mlx-lm raises on it inside compiled code,
            # which leaves MLX's random state broken for every later request of the process
            self._filters.append(lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x)
        seed = params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        self._key = mx.random.key(seed)
        for _ in range(params.steps_done):
            self._key, _ = mx.random.split(self._key)

    def __call__(self, logits: mx.array) -> int:
        """Pick the next token id from float logits of shape ``(vocab,)``."""
        if self._greedy:
            return int(mx.argmax(logits, axis=-1).item())
        logprobs = logits.astype(mx.float32)[None]
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        for keep in self._filters:
            logprobs = keep(logprobs)
        self._key, draw = mx.random.split(self._key)
        return int(mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=draw)[0].item())
