"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-sequence seed.

Every sequence owns a `torch.Generator` seeded from its `seed`, so a sampled completion depends
only on (model, prompt, parameters, seed), never on which other prompts share the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from distlm.inference.prompts import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens. temperature == 0 means greedy (argmax)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0

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


def make_params(
    *,
    max_new_tokens,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=0,
    context: int,
    max_allowed: int | None = None,
) -> SamplingParams:
    """Validated SamplingParams; each error names the field (`max_tokens` style names for HTTP)."""
    n = _number(max_new_tokens, "max_tokens", integer=True)
    if n <= 0:
        raise RequestError(f"max_tokens: must be at least 1, got {n}", param="max_tokens")
    if n >= context:
        raise RequestError(
            f"max_tokens: {n} is beyond the model's context of {context} tokens "
            f"(at most {context - 1} leaves room for a one-token prompt)",
            param="max_tokens",
        )
    if max_allowed is not None and n > max_allowed:
        raise RequestError(
            f"max_tokens: {n} is above this server's limit of {max_allowed} (inference.serve.max_tokens)",
            param="max_tokens",
        )
    t = float(_number(temperature, "temperature"))
    if t < 0:
        raise RequestError(f"temperature: must be >= 0, got {t}", param="temperature")
    k = _number(top_k, "top_k", integer=True)
    if k < 0:
        raise RequestError(f"top_k: must be >= 0 (0 disables it), got {k}", param="top_k")
    p = float(_number(top_p, "top_p"))
    if not 0.0 < p <= 1.0:
        raise RequestError(f"top_p: must be in (0, 1], got {p}", param="top_p")
    s = _number(seed, "seed", integer=True)
    if s < 0:
        raise RequestError(f"seed: must be >= 0, got {s}", param="seed")
    return SamplingParams(max_new_tokens=n, temperature=t, top_k=k, top_p=p, seed=s)


def params_from_config(icfg: dict, *, context: int, seed_offset: int = 0) -> SamplingParams:
    """The batch stage's sampling parameters from the `inference` config section."""
    return make_params(
        max_new_tokens=icfg["max_new_tokens"],
        temperature=0.0 if icfg["greedy"] else icfg["temperature"],
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
    """One token id from `logits` (V,): argmax when greedy, else filtered sampling."""
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
    return int(torch.multinomial(probs, 1, generator=gen))
