"""Token sampling on the last stage: greedy, temperature, top-p, top-k, seeded.

The sampler chain is mlx-lm's (``mlx_lm.sample_utils.make_sampler``). Each request
has its own random key, so a seeded request samples the same tokens whatever else
the node is serving: the global MLX key is swapped in around the sampler call
(all MLX work of a node runs on its one worker thread, so the swap is race-free).
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
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


class RequestSampler:
    """Samples one request's tokens from last-stage logits ``(vocab,)``."""

    def __init__(self, params: SamplingParams):
        from mlx_lm.sample_utils import make_sampler

        self.params = params
        self._greedy = params.temperature == 0
        top_p = params.top_p if 0 < params.top_p < 1 else 0.0
        self._sampler = make_sampler(temp=params.temperature, top_p=top_p, top_k=params.top_k)
        seed = params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> int:
        """Pick the next token id from float logits of shape ``(vocab,)``."""
        if self._greedy:
            return int(mx.argmax(logits, axis=-1).item())
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        saved = mx.random.state[0]
        mx.random.state[0] = self._key
        try:
            token = int(self._sampler(logprobs[None])[0].item())
            self._key = mx.random.state[0]
        finally:
            mx.random.state[0] = saved
        return token
