"""Prompts: a prompt file (one per line), where a relative path is found, and prompt tokens.

Kept free of torch so the workflow can import it when it builds the DAG.
"""

from __future__ import annotations

import functools
from pathlib import Path

from distlm import DistlmError


class RequestError(DistlmError):
    """A bad generation request (or prompt), neutral: `param` names the field in the request's
    own terms (max_new_tokens, temperature, prompt, ...) and the message starts with it; `index`:
    which prompt of several. Each edge names the field its own way (`named`): the API server as
    its HTTP parameter (max_tokens), the batch stage as its config key (inference.<field>).
    `status` is the HTTP code."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, index: int | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.index = index

    @property
    def detail(self) -> str:
        """The message without the field's name in front."""
        text = str(self)
        prefix = f"{self.param}: "
        return text[len(prefix) :] if self.param and text.startswith(prefix) else text

    def named(self, name: str) -> str:
        """The message with the field called `name`."""
        return f"{name}: {self.detail}"


def encode_prompt(
    tok, text: str, *, context: int, max_new_tokens: int, overflow: str
) -> tuple[list[int], int]:
    """Token ids of a prompt and how many leading tokens were dropped to fit the context."""
    if not isinstance(text, str) or not text:
        raise RequestError("prompt: empty prompt", param="prompt")
    # with the tokenizer's own special tokens (a Llama 3 tokenizer's BOS; GPT-2's adds none), as
    # transformers' pipelines and vLLM's /v1/completions encode a text prompt
    ids = text_ids(tok, text)
    if not ids:
        raise RequestError("prompt: the prompt has no tokens", param="prompt")
    return _fit(ids, context=context, max_new_tokens=max_new_tokens, overflow=overflow)


def text_ids(tok, text: str) -> list[int]:
    """`tok(text)["input_ids"]`: a text's token ids with the tokenizer's own special tokens.

    Where that call is the tokenizers library's encode and nothing more (`runs_backend`, and
    the backend without truncation or padding, splitting special tokens as the tokenizer says),
    the library's encode is called directly: transformers' Python around it costs ~15 us a
    prompt, a few percent of the API server's CPU a request."""
    backend = tok.backend_tokenizer if runs_backend(type(tok)) else None
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == tok.split_special_tokens
    ):
        return backend.encode(text).ids
    return tok(text)["input_ids"]


@functools.cache
def runs_backend(cls: type) -> bool:
    """Whether a tokenizer of class `cls` encodes (`tok(text)`) and decodes (`tok.decode(ids)`)
    as transformers' TokenizersBackend does, no method of it changed: the tokenizers library's
    encode_batch (after setting no truncation and no padding) and decode (then a clean-up of
    spaces where `clean_up_tokenization_spaces` asks for one). transformers' classes are found
    among `cls`'s bases, not imported (this module imports no transformers)."""
    bases = {f"{c.__module__}.{c.__qualname__}": c for c in cls.__mro__}
    base = bases.get("transformers.tokenization_utils_base.PreTrainedTokenizerBase")
    fast = bases.get("transformers.tokenization_utils_tokenizers.TokenizersBackend")
    if base is None or fast is None or hasattr(cls, "_switch_to_input_mode"):
        return False
    same = [
        (base, "__call__"),
        (base, "_get_padding_truncation_strategies"),
        (fast, "_encode_plus"),
        (fast, "set_truncation_and_padding"),
        (fast, "_convert_encoding"),
        (base, "decode"),
        (fast, "_decode"),
    ]
    return all(getattr(cls, name, None) is getattr(owner, name, False) for owner, name in same)


def _fit(
    ids: list[int], *, context: int, max_new_tokens: int, overflow: str
) -> tuple[list[int], int]:
    room = context - max_new_tokens
    if len(ids) <= room:
        return ids, 0
    if overflow != "truncate":
        raise RequestError(
            f"prompt: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the model's context "
            f"of {context} ({'inference.prompt_overflow is reject' if overflow == 'reject' else overflow})",
            param="prompt",
        )
    return ids[len(ids) - room :], len(ids) - room


def check_prompt_ids(
    ids: list[int], *, vocab_size: int, context: int, max_new_tokens: int, overflow: str
) -> tuple[list[int], int]:
    """A prompt given as token ids (lm-eval sends these): checked against the vocabulary, then
    fitted to the context as encode_prompt does; (ids, how many leading ones were dropped)."""
    if not ids:
        raise RequestError("prompt: empty list of token ids", param="prompt")
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise RequestError(
            f"prompt: token id {t} (position {i}) is outside the vocabulary of {vocab_size} "
            f"tokens (0..{vocab_size - 1}); {len(bad)} such ids",
            param="prompt",
        )
    return _fit(list(ids), context=context, max_new_tokens=max_new_tokens, overflow=overflow)


def resolve_prompts_path(path: str | Path, root: str | Path | None) -> Path:
    """A relative prompt file is looked up in the working directory first (the user's project),
    then the workflow's own folder `root` (None: the workflow came from a remote source)."""
    p = Path(path)
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [Path.cwd() / p, *([Path(root) / p] if root is not None else [])]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DistlmError(
        f"inference.prompts: prompt file {str(path)!r} not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + ")"
    )


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-blank line (UTF-8); `\\n` in a line stands for a newline."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DistlmError(f"prompt file not found: {path}") from None
    prompts = []
    for i, line in enumerate(raw.split(b"\n"), 1):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise DistlmError(f"{path}:{i}: not valid UTF-8 ({e})") from None
        if text.strip():
            prompts.append(text.replace("\\n", "\n"))
    if not prompts:
        raise DistlmError(f"{path}: no prompts (one per non-blank line)")
    return prompts
