"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-sequence seed.

Every sequence owns a `torch.Generator` seeded from its `seed`, so a sampled completion depends
only on (model, prompt, parameters, seed), never on which other prompts share the pipeline.

No request can make sampling raise for the whole pipeline: a temperature below GREEDY_BELOW is
greedy (dividing by it would overflow to inf/NaN), seeds are refused outside 0..MAX_SEED (what
`manual_seed` takes), top_k is capped at the vocabulary, and `pick_token` raises SamplingError
(which fails that one sequence) when the distribution it would draw from is not finite.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from distlm import DistlmError
from distlm.inference.prompts import RequestError

GREEDY_BELOW = 1e-5  # a smaller temperature is greedy (as vLLM's _SAMPLING_EPS)
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_LOGPROBS = 20  # the most alternatives `logprobs` may ask for


class SamplingError(DistlmError):
    """Sampling one sequence failed (a non-finite distribution): that sequence fails, no other."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens. temperature == 0 means greedy (argmax)."""

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
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _number(value, name: str, *, integer: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{name}: expected {kind}, got {value!r}", param=name)
    return value


def _logprobs(value) -> int | None:
    """The request's `logprobs` (alternatives per token), checked; None when not asked for."""
    if value is None:
        return None
    lp = _number(value, "logprobs", integer=True)
    if not 0 <= lp <= MAX_LOGPROBS:
        raise RequestError(f"logprobs: must be in 0..{MAX_LOGPROBS}, got {lp}", param="logprobs")
    return lp


def make_params(
    *,
    max_new_tokens,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=0,
    logprobs=None,
    prompt_logprobs=None,
    echo: bool = False,
    context: int,
    vocab_size: int | None = None,
    max_allowed: int | None = None,
) -> SamplingParams:
    """Validated SamplingParams; each error names the field (`max_tokens` style names for HTTP).

    `prompt_logprobs` (echo with logprobs) scores the prompt too. With `echo`, max_tokens may
    be 0: the prompt only (with logprobs its log-probabilities, as lm-eval's log-likelihood
    requests ask)."""
    n = _number(max_new_tokens, "max_tokens", integer=True)
    if n < 0 or (n == 0 and not echo):
        raise RequestError(
            f"max_tokens: must be at least 1 (0 only with echo: the prompt alone), got {n}",
            param="max_tokens",
        )
    if n >= context:
        raise RequestError(
            f"max_tokens: {n} is beyond the model's context of {context} tokens "
            f"(at most {context - 1} leaves room for a one-token prompt)",
            param="max_tokens",
        )
    if max_allowed is not None and n > max_allowed:
        raise RequestError(
            f"max_tokens: {n} is above this server's limit of {max_allowed} (serve.max_tokens)",
            param="max_tokens",
        )
    t = float(_number(temperature, "temperature"))
    if t < 0:
        raise RequestError(f"temperature: must be >= 0, got {t}", param="temperature")
    if t < GREEDY_BELOW:
        t = 0.0  # greedy: 1 / t would overflow the logits to inf
    k = _number(top_k, "top_k", integer=True)
    if k < 0:
        raise RequestError(f"top_k: must be >= 0 (0 disables it), got {k}", param="top_k")
    if vocab_size is not None and k >= vocab_size:
        k = 0  # keeping the whole vocabulary is no filter
    p = float(_number(top_p, "top_p"))
    if not 0.0 < p <= 1.0:
        raise RequestError(f"top_p: must be in (0, 1], got {p}", param="top_p")
    s = _number(seed, "seed", integer=True)
    if not 0 <= s <= MAX_SEED:
        raise RequestError(f"seed: must be in 0..2**63-1, got {s}", param="seed")
    logprobs = _logprobs(logprobs)
    prompt_logprobs = _logprobs(prompt_logprobs)  # the request's `logprobs`, with echo
    return SamplingParams(
        max_new_tokens=n,
        temperature=t,
        top_k=k,
        top_p=p,
        seed=s,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def params_from_config(icfg: dict, *, context: int, seed_offset: int = 0) -> SamplingParams:
    """The batch stage's sampling parameters from the `inference` config section."""
    return make_params(
        max_new_tokens=icfg["max_new_tokens"],
        temperature=icfg["temperature"],
        top_k=icfg["top_k"],
        top_p=icfg["top_p"],
        seed=icfg["seed"] + seed_offset,
        context=context,
    )


def new_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed)
    return g


def pick_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from `logits` (V,): argmax when greedy, else filtered sampling.

    Raises SamplingError when the logits or the filtered distribution are not finite.
    """
    if not bool(torch.isfinite(logits).any()):
        raise SamplingError("the model's logits are not finite")
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise SamplingError(f"temperature {params.temperature:g} gives no finite distribution")
    return int(torch.multinomial(probs, 1, generator=gen))


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its `n` most likely tokens (temperature 1)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, min(n, lp.numel())) if n else None
    alts = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return float(lp[token]), alts


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], n: int
) -> tuple[tuple[float, tuple[tuple[int, float], ...]], ...]:
    """Each prompt token's log-probability given the tokens before it, and the `n` most likely.

    `logits` (T - 1, V) are the positions 0 .. T-2 of a T-token prompt; `targets` its tokens
    1 .. T-1. The first prompt token has no log-probability (nothing comes before it)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T - 1, V)
    chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1)
    if n:
        top = torch.topk(lp, min(n, lp.shape[1]), dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [() for _ in targets]
    return tuple(zip(chosen.tolist(), alts))
