"""The wire forms (``ringlet.proto``) of sampling parameters and of a sampled token's
scores."""

from __future__ import annotations

from ringlet.daemon.engine.sampling import SamplingParams, Token
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb


def sampling_from_pb(message: pb.Sampling | None) -> SamplingParams:
    """Sampling parameters from their wire form (unset fields mean "off")."""
    if message is None:
        return SamplingParams()
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed if message.has_seed else None,
        steps_done=message.steps_done,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        logit_bias=tuple(zip(message.logit_bias_ids, message.logit_bias_values, strict=False)),
        logprobs=message.top_logprobs if message.logprobs else -1,
        grammar=message.grammar,
    )


def sampling_to_pb(params: SamplingParams) -> pb.Sampling:
    """The wire form of sampling parameters."""
    return pb.Sampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        steps_done=params.steps_done,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias_ids=[t for t, _ in params.logit_bias],
        logit_bias_values=[b for _, b in params.logit_bias],
        logprobs=params.logprobs >= 0,
        top_logprobs=max(0, params.logprobs),
        grammar=params.grammar,
    )


def scores_to_pb(token: int) -> pb.TokenScores | None:
    """A sampled token's scores in wire form, or ``None`` when it carries none."""
    logprob = getattr(token, "logprob", None)
    if logprob is None:
        return None
    return pb.TokenScores(logprob=logprob, top_ids=[i for i, _ in token.top],
                          top_logprobs=[v for _, v in token.top])


def token_from_pb(message: pb.Activation | pb.GenerateEvent) -> Token:
    """The token of an activation or a generate event, with the scores that came with it."""
    if not message.HasField("scores"):
        return Token(message.token)
    token, scores = message.token, message.scores
    return Token(token, scores.logprob, tuple(zip(scores.top_ids, scores.top_logprobs, strict=False)))


def tokens_from_pb(message: pb.Activation) -> list[Token]:
    """A verifying step's tokens (``Activation.tokens``: accepted drafts, then the next
    token), with their scores when they came with them."""
    scores = list(message.token_scores)
    if len(scores) != len(message.tokens):
        return [Token(t) for t in message.tokens]
    return [Token(t, s.logprob, tuple(zip(s.top_ids, s.top_logprobs, strict=False)))
            for t, s in zip(message.tokens, scores, strict=True)]
