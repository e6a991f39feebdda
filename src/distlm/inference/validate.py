"""The one request path: prompts (text or token ids) and sampling settings in, a validated,
tokenized request out, for the API server and the batch stage alike.

    req = prepare_request(["A class"], {"max_new_tokens": 8, "temperature": 0.0}, tokenizer=tok,
                          context=1024, overflow="truncate")

Every error is a RequestError naming the field in neutral terms (max_new_tokens, temperature,
prompt, ...; `index` says which prompt). The edges name it their way: the API server answers 400
with `param` set to the HTTP field (HTTP_NAMES), the batch stage raises an error naming the
config key `inference.<field>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distlm.inference.prompts import RequestError, check_prompt_ids, encode_prompt
from distlm.inference.sampling import SamplingParams, make_params

# neutral field -> the OpenAI completions field that sets it (the others keep their names)
HTTP_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}


@dataclass(frozen=True)
class PreparedRequest:
    """Prompts tokenized and fitted to the context, with their sampling parameters."""

    ids: list[list[int]]  # per prompt, its token ids
    truncated: list[int]  # per prompt, how many leading tokens were dropped to fit the context
    texts: list[str]  # per prompt, its text (token ids decoded)
    params: SamplingParams


def prepare_request(
    prompts: Sequence[str | list[int]],
    sampling: Mapping[str, object],
    *,
    tokenizer,
    context: int,
    overflow: str,
    vocab_size: int | None = None,
    max_allowed: int | None = None,
    echo: bool = False,
) -> PreparedRequest:
    """Validate `sampling` (max_new_tokens, temperature, top_k, top_p, seed, logprobs,
    prompt_logprobs) and tokenize each prompt; RequestError naming the field otherwise.

    `overflow`: what a prompt too long for the context gets (truncate or reject, or a sentence
    saying why it is refused); `max_allowed`: the server's limit on max_new_tokens; `echo`: the
    prompt is returned too, so max_new_tokens may be 0."""
    params = make_params(
        **sampling,
        echo=echo,
        context=context,
        vocab_size=vocab_size,
        max_allowed=max_allowed,
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
