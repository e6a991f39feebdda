"""How one sequence picks its tokens: `SamplingParams` (greedy, or temperature / top-k / top-p
with a per-sequence seed, and the log-probabilities asked for), made from validated settings by
`make_params`; the engine's last stage picks by them (distlm.inference.engine.sampler).

No request can make sampling raise for the whole pipeline: a temperature below GREEDY_BELOW is
greedy (dividing by it would overflow to inf/NaN), seeds outside 0..MAX_SEED (what
`manual_seed` takes) are refused by SamplingSettings (distlm.settings, where every sampling
range is checked), and top_k is capped at the vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pydantic import ConfigDict

from distlm.inference.prompts import RequestError
from distlm.settings import SamplingSettings

GREEDY_BELOW = 1e-5  # a smaller temperature is greedy (as vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the most alternatives `logprobs` may ask for


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens, as the engine channel and the ring carry it: a
    SamplingSettings checked against the model and the server (make_params), with the
    log-probabilities a request asks for. A temperature below GREEDY_BELOW is greedy (argmax)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # as an engine-channel field

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0
    logprobs: int | None = None  # None: no log-probabilities; N: the chosen token's and the top N
    # None: none for the prompt; N: each prompt token's log-probability and the top N (echo)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Argmax: the one definition of greedy (1 / temperature would overflow below it)."""
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        return asdict(self)


def _logprobs(value) -> int | None:
    """The request's `logprobs` (alternatives per token), checked; None when not asked for."""
    if value is None:
        return None
    lp = value
    if isinstance(lp, bool) or not isinstance(lp, int):
        raise RequestError(f"logprobs: expected an integer, got {lp!r}", param="logprobs")
    if not 0 <= lp <= MAX_LOGPROBS:
        raise RequestError(f"logprobs: must be in 0..{MAX_LOGPROBS}, got {lp}", param="logprobs")
    return lp


def make_params(
    sampling: SamplingSettings,
    *,
    context: int,
    logprobs=None,
    prompt_logprobs=None,
    vocab_size: int | None = None,
    max_allowed: int | None = None,
) -> SamplingParams:
    """One sequence's SamplingParams from validated SamplingSettings (their ranges are checked
    there, once), checked against what only the model and the server know: the context, the
    server's limit (`max_allowed`, serve.max_tokens) and the vocabulary (a top_k that keeps it
    all is no filter). Each error is a RequestError naming the field (neutral names).

    `logprobs`: the alternatives per token a request asks for; `prompt_logprobs` (echo with
    logprobs) scores the prompt too. `sampling.max_new_tokens` 0 (set by an echo request, never
    by validation) is the prompt only."""
    n = sampling.max_new_tokens
    if n >= context:
        raise RequestError(
            f"max_new_tokens: {n} is beyond the model's context of {context} tokens "
            f"(at most {context - 1} leaves room for a one-token prompt)",
            param="max_new_tokens",
        )
    if max_allowed is not None and n > max_allowed:
        raise RequestError(
            f"max_new_tokens: {n} is above this server's limit of {max_allowed} (serve.max_tokens)",
            param="max_new_tokens",
        )
    k = sampling.top_k
    if vocab_size is not None and k >= vocab_size:
        k = 0  # keeping the whole vocabulary is no filter
    return SamplingParams(
        max_new_tokens=n,
        temperature=float(sampling.temperature),
        top_k=k,
        top_p=float(sampling.top_p),
        seed=sampling.seed,
        logprobs=_logprobs(logprobs),
        prompt_logprobs=_logprobs(prompt_logprobs),  # the request's `logprobs`, with echo
    )
