"""How an answer looks: OpenAI's completion or chat completion, whole or as stream chunks.

The two routes share the request path, the engine job and the Answer (render.py); a Shape is all
that differs in the answer: a completion choice has `text` (and `echo`, `text_offset`), a chat
choice a `message` (stream: a `delta`, the role first) and the chat logprobs object
(`content[{token, logprob, bytes, top_logprobs}]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from distlm.inference.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionChunk,
    Logprobs,
    Usage,
)


class Answer(Protocol):
    """What a shape reads of an answer (render.Answer is the one; named here by what it offers,
    so that shapes, the request's Job that holds a shape, and the Answer that holds the Job import
    no cycle)."""

    @property
    def job(self) -> Any: ...  # prepare.Job: its prompts, params and truncated counts

    @property
    def choices(self) -> Sequence[Any]: ...  # render.Choice: a choice's tokens, finish reason

    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer

    def prompt_index(self, index: int) -> int: ...

    def text(self, index: int) -> str: ...

    def usage(self) -> Usage: ...

    def scored(
        self, index: int, since: int = 0, *, prompt: bool = False, tokens: bool = True
    ) -> tuple[list[int], list[float | None], list[list | None]]: ...


class Shape(Protocol):
    """What makes an answer OpenAI's completion or chat completion."""

    prefix: str  # of the answer's id

    def choice(self, answer: Answer, index: int) -> BaseModel:
        """A finished choice (stream false)."""
        ...

    def document(
        self,
        answer: Answer,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
    ) -> BaseModel:
        """The whole answer (stream false)."""
        ...

    def opening(self, answer: Answer, index: int) -> BaseModel | None:
        """A choice's first stream chunk, before any token (None: none)."""
        ...

    def piece(
        self, answer: Answer, index: int, text: str, reason: str | None, logprobs: Any
    ) -> BaseModel:
        """A stream chunk's choice: new text, its logprobs, the finish reason on the last."""
        ...

    def logprobs(
        self,
        answer: Answer,
        index: int,
        since: int = 0,
        *,
        prompt: bool = False,
        tokens: bool = True,
    ) -> BaseModel | None:
        """The logprobs object of a choice's tokens from `since` on (None: not asked for);
        `prompt`: the prompt's first; `tokens` False: the prompt's alone."""
        ...

    def chunk(
        self,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
        usage: Usage | None = None,
    ) -> BaseModel:
        """One stream chunk (the usage chunk has no choices)."""
        ...


class CompletionShape:
    """OpenAI's completions answer (`text_completion`)."""

    prefix = "cmpl"

    def choice(self, answer: Answer, index: int) -> CompletionChoice:
        job, p = answer.job, answer.prompt_index(index)
        text = answer.text(index)
        return CompletionChoice(
            text=job.prompts[p] + text if job.echo else text,
            index=index,
            logprobs=self.logprobs(answer, index, prompt=job.echo),
            finish_reason=answer.choices[index].reason,
            prompt_truncated_tokens=job.truncated[p],
        )

    def document(
        self,
        answer: Answer,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
    ) -> Completion:
        warnings = [
            f"prompt {i}: dropped its first {cut} tokens to fit the context "
            "(inference.prompt_overflow is truncate)"
            for i, cut in enumerate(answer.job.truncated)
            if cut
        ]
        return Completion(
            id=id,
            created=created,
            model=model,
            choices=choices,
            usage=answer.usage(),
            system_fingerprint=system_fingerprint,
            warnings=warnings or None,
        )

    def opening(self, answer: Answer, index: int) -> ChunkChoice | None:
        """With echo (not scored: a scored prompt goes out after its prefill), the prompt."""
        job = answer.job
        if not job.echo or job.params.prompt_logprobs is not None:
            return None
        return ChunkChoice(
            text=job.prompts[answer.prompt_index(index)], index=index, finish_reason=None
        )

    def piece(
        self, answer: Answer, index: int, text: str, reason: str | None, logprobs
    ) -> ChunkChoice:
        last = reason is not None
        return ChunkChoice(
            text=text,
            index=index,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_truncated_tokens=(
                answer.job.truncated[answer.prompt_index(index)] if last else None
            ),
        )

    def logprobs(
        self,
        answer: Answer,
        index: int,
        since: int = 0,
        *,
        prompt: bool = False,
        tokens: bool = True,
    ) -> Logprobs | None:
        """OpenAI's logprobs object for the tokens from `since` on; `prompt`: the echoed prompt's
        tokens first (the first one's log-probability and alternatives null, as OpenAI and vLLM
        give them). text_offset: each token's offset in the choice's text."""
        job = answer.job
        if job.params.logprobs is None:
            return None
        c, tok = answer.choices[index], answer.tokenizer
        ids, lps, tops = answer.scored(index, since, prompt=prompt, tokens=tokens)
        offset = 0
        if not (prompt and c.prompt is not None) and job.echo:
            offset = len(job.prompts[answer.prompt_index(index)])  # after the echoed prompt
        if since:
            offset += len(tok.decode(c.tokens[:since]))
        words = [tok.decode([t]) for t in ids]
        offsets = []
        for w in words:
            offsets.append(offset)
            offset += len(w)
        return Logprobs(
            tokens=words,
            token_logprobs=lps,
            top_logprobs=[
                None if top is None else {tok.decode([int(t)]): lp for t, lp in top} for top in tops
            ],
            text_offset=offsets,
        )

    def chunk(
        self,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
        usage: Usage | None = None,
    ) -> CompletionChunk:
        return CompletionChunk(
            id=id,
            created=created,
            model=model,
            choices=choices,
            system_fingerprint=system_fingerprint,
            usage=usage,
        )


def _utf8(word: str) -> list[int]:
    """A token's bytes as OpenAI gives them (vLLM: its decoded text in UTF-8)."""
    return list(word.encode("utf-8", errors="replace"))


class ChatShape:
    """OpenAI's chat completions answer (`chat.completion`, `chat.completion.chunk`)."""

    prefix = "chatcmpl"

    def choice(self, answer: Answer, index: int) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=answer.text(index)),
            logprobs=self.logprobs(answer, index),
            finish_reason=answer.choices[index].reason,
        )

    def document(
        self,
        answer: Answer,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
    ) -> ChatCompletion:
        return ChatCompletion(
            id=id,
            created=created,
            model=model,
            choices=choices,
            usage=answer.usage(),
            system_fingerprint=system_fingerprint,
        )

    def opening(self, answer: Answer, index: int) -> ChatChunkChoice:
        """The role first, as OpenAI and vLLM stream it."""
        return ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))

    def piece(
        self, answer: Answer, index: int, text: str, reason: str | None, logprobs
    ) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index, delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=reason
        )

    def logprobs(
        self,
        answer: Answer,
        index: int,
        since: int = 0,
        *,
        prompt: bool = False,
        tokens: bool = True,
    ) -> ChatLogprobs | None:
        if answer.job.params.logprobs is None:
            return None
        tok = answer.tokenizer
        ids, lps, tops = answer.scored(index, since)
        content = []
        for t, lp, top in zip(ids, lps, tops):
            word = tok.decode([t])
            alts = []
            for a, alp in top or ():
                w = tok.decode([int(a)])
                alts.append(ChatTopLogprob(token=w, logprob=alp, bytes=_utf8(w)))
            assert lp is not None  # a generated token's log-probability (asked for)
            content.append(
                ChatTokenLogprob(token=word, logprob=lp, bytes=_utf8(word), top_logprobs=alts)
            )
        return ChatLogprobs(content=content)

    def chunk(
        self,
        *,
        id: str,
        created: int,
        model: str,
        choices: list,
        system_fingerprint: str,
        usage: Usage | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=id,
            created=created,
            model=model,
            choices=choices,
            system_fingerprint=system_fingerprint,
            usage=usage,
        )
