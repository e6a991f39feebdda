"""The one request path: prompts (text or token ids) and sampling settings in, a validated,
tokenized request out, for the API server and the batch stage alike.

    sampling = sampling_settings({"temperature": 0.7}, defaults=settings.inference)
    req = prepare_request(["A class"], sampling, tokenizer=tok, context=1024, overflow="truncate")

Sampling ranges are SamplingSettings' (distlm.settings), checked there and nowhere else:
`sampling_settings` lays a request's values over the defaults and validates them through it.

Every error is a RequestError naming the field in neutral terms (max_new_tokens, temperature,
prompt, ...; `index` says which prompt). The edges name it their way: the API server answers 400
with `param` set to the HTTP field (HTTP_NAMES), the batch stage raises an error naming the
config key `inference.<field>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from distlm.inference.prompts import RequestError, check_prompt_ids, encode_prompt
from distlm.inference.sampling_params import SamplingParams, make_params
from distlm.settings import SamplingSettings

# neutral field -> the OpenAI completions field that sets it (the others keep their names)
HTTP_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}


@dataclass(frozen=True)
class PreparedRequest:
    """Prompts tokenized and fitted to the context, with their sampling parameters."""

    ids: list[list[int]]  # per prompt, its token ids
    truncated: list[int]  # per prompt, how many leading tokens were dropped to fit the context
    texts: list[str]  # per prompt, its text (token ids decoded)
    params: SamplingParams


def sampling_settings(
    given: Mapping[str, object], *, defaults: SamplingSettings
) -> SamplingSettings:
    """`given` (None: not given) over `defaults`, validated by SamplingSettings; a RequestError
    naming the field and its range otherwise. With nothing given, `defaults` itself (the
    `inference` settings are SamplingSettings: nothing is rebuilt)."""
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return defaults
    # requests repeat their settings (a client's max_tokens and temperature), and validating
    # them costs ~8 us: a settings object once made is reused (frozen). Keyed by each value's
    # type too: True == 1 and 1.0 == 1, but strict validation tells them apart.
    try:
        key = (id(defaults), *((k, type(v), v) for k, v in sorted(given.items())))
        hit = _made.get(key)
    except TypeError:  # an unhashable value (a list): validated below, and refused there
        key, hit = None, None
    if hit is not None and hit[0] is defaults:
        return hit[1]
    values = {k: getattr(defaults, k) for k in SamplingSettings.model_fields}
    values.update(given)
    try:
        made = SamplingSettings.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "sampling"
        if field not in SamplingSettings.model_fields:
            raise RequestError(f"{field}: {err['msg']}", param=field) from None
        got = values.get(field)
        raise RequestError(f"{field}: {_expected(field, err)}, got {got!r}", param=field) from None
    if key is not None:
        if len(_made) >= _MADE_MAX:
            _made.clear()
        _made[key] = (defaults, made)  # `defaults` held: its id is not reused while kept
    return made


# validated sampling settings by (the defaults' id, the given values): sampling_settings'
_made: dict[tuple, tuple[SamplingSettings, SamplingSettings]] = {}
_MADE_MAX = 1024


def _expected(field: str, err) -> str:
    """What a SamplingSettings field takes, from its own constraints (one definition of each)."""
    info = SamplingSettings.model_fields[field]
    integer = info.annotation is int
    if not err["type"].startswith(("greater", "less")):
        return f"expected {'an integer' if integer else 'a number'}"
    b = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le") if hasattr(m, k)}
    if "le" in b:
        low = f"{b['ge']}.." if "ge" in b else f"({b['gt']:g}, "
        high = _number(b["le"]) if "ge" in b else f"{b['le']:g}]"
        return f"must be in {low}{high}"
    if "gt" in b:
        return f"must be > {b['gt']:g}"
    return f"must be >= {b['ge']:g}"


def _number(x: float) -> str:
    """2**63-1 rather than its 19 digits."""
    if isinstance(x, int) and x > 2**32 and (x + 1) & x == 0:
        return f"2**{(x + 1).bit_length() - 1}-1"
    return f"{x:g}"


def prepare_request(
    prompts: Sequence[str | list[int]],
    sampling: SamplingSettings,
    *,
    tokenizer,
    context: int,
    overflow: str,
    vocab_size: int | None = None,
    max_allowed: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> PreparedRequest:
    """Check `sampling` against the model and the server, and tokenize each prompt; RequestError
    naming the field otherwise.

    `overflow`: what a prompt too long for the context gets (truncate or reject, or a sentence
    saying why it is refused); `max_allowed`: the server's limit on max_new_tokens; `logprobs`,
    `prompt_logprobs`: log-probabilities to return (a completions request's)."""
    params = make_params(
        sampling,
        context=context,
        vocab_size=vocab_size,
        max_allowed=max_allowed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    ids, truncated, texts = [], [], []
    for i, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, str):
                got, cut = encode_prompt(
                    tokenizer,
                    prompt,
                    context=context,
                    max_new_tokens=params.max_new_tokens,
                    overflow=overflow,
                )
            else:
                got, cut = check_prompt_ids(
                    prompt,
                    vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
                    context=context,
                    max_new_tokens=params.max_new_tokens,
                    overflow=overflow,
                )
        except RequestError as e:
            raise RequestError(str(e), param=e.param, index=i) from None
        ids.append(got)
        truncated.append(cut)
        texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(got))
    return PreparedRequest(ids, truncated, texts, params)
