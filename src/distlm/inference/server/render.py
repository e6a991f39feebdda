"""One request's answer as the engine's events arrive, for either route: each choice's tokens,
text, stop strings, log-probabilities and the usage. How it looks (completions or chat) is the
job's shape (shapes.py).

A choice's text, where it is needed as tokens arrive (to stream it, or to find stop strings), is
decoded incrementally: the tokenizers library's DecodeStream turns each new token into the text
it adds, holding back an incomplete UTF-8 character (vLLM's and TGI's way; decoding the whole text
after every token costs O(n^2)). At the choice's end the text is decoded once whole, so it is the
tokenizer's decode exactly (a last incomplete character included). A tokenizer whose decode
differs from its pieces joined (a slow one, or one that cleans up spaces after decoding:
`clean_up_tokenization_spaces`) decodes the whole text each time instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from distlm.inference.messages import Error, Finish, Prompt, Token
from distlm.inference.prompts import runs_backend
from distlm.inference.server.errors import ApiError
from distlm.inference.server.metrics import Metrics
from distlm.inference.server.prepare import Job
from distlm.inference.server.responses import Usage


@dataclass
class Choice:
    """What the API server knows of one sequence while it runs."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list | None] = field(default_factory=list)
    prompt: Prompt | None = None  # the prompt's log-probabilities (echo with logprobs)
    reason: str | None = None
    error: str | None = None
    t_last: float = 0.0
    decoder: DecodeStream | None = None  # its text so far, decoded incrementally


def decodes_incrementally(tokenizer: Any) -> bool:
    """Whether a DecodeStream's pieces joined are this tokenizer's decode, and that decode is
    the tokenizers library's: a fast tokenizer that decodes as transformers' own does
    (`runs_backend`) and does not clean up spaces after decoding."""
    return runs_backend(type(tokenizer)) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    )


class Answer:
    """One request's choices as the engine's events arrive; text, stops and logprobs.

    It needs the tokenizer (text), the metrics (time to first token, inter-token latency,
    tokens), `cancel(rid, index)`, to stop a choice whose stop string has arrived, and
    `fingerprint()`, the served weights' fingerprint, which the answer names: read at the
    request's first event, since a request held back by a live update runs on the weights
    after it (stage 0 tells every channel the new weights before any event they produce)."""

    def __init__(
        self,
        job: Job,
        rid: int,
        t0: float,
        *,
        tokenizer: Any,  # a transformers tokenizer
        metrics: Metrics,
        cancel: Callable[[int, int], None],
        fingerprint: Callable[[], str],
    ) -> None:
        self.job, self.rid, self.t0 = job, rid, t0
        self._fingerprint = fingerprint
        self.fingerprint = fingerprint()  # the weights that produce it, from its first event
        self.heard = False  # an event of the engine arrived
        self.tokenizer, self.metrics, self.cancel = tokenizer, metrics, cancel
        self.n = job.n
        self.choices = [Choice(i) for i in range(len(job.prompts) * self.n)]
        self.texts = ["" for _ in self.choices]
        self.sent = [0 for _ in self.choices]  # characters streamed so far (per choice)
        self.lp_sent = [0 for _ in self.choices]  # tokens whose logprobs were streamed
        self.prompt_sent = [False for _ in self.choices]  # a scored prompt streamed (echo)
        self.left = len(self.choices)
        self.t_first: float | None = None
        self.hold = max((len(s) for s in job.stops), default=1) - 1
        # the text is needed as tokens arrive only to find stop strings or to stream it; else it
        # is decoded once, at the end (a decode of the whole text after every token is O(n^2))
        self.live = bool(job.stops) or job.stream
        self.backend = tokenizer.backend_tokenizer if decodes_incrementally(tokenizer) else None
        if self.live and self.backend is not None:
            for c in self.choices:
                c.decoder = DecodeStream(skip_special_tokens=True)

    def prompt_index(self, index: int) -> int:
        return index // self.n

    def event(self, msg: Prompt | Token | Finish | Error) -> list[int]:
        """Take one engine event; the choices it changed. Raises ApiError for a pipeline failure."""
        if isinstance(msg, Error) and (msg.rid is None or msg.index is None):
            raise ApiError(503, f"the pipeline is unavailable: {msg.message}")
        assert msg.index is not None  # an Error with a rid names its choice (messages.Error)
        if not self.heard:
            self.heard = True
            self.fingerprint = self._fingerprint()
        c = self.choices[msg.index]
        now = time.perf_counter()
        m = self.metrics
        if isinstance(msg, Prompt):
            c.prompt = msg
        elif isinstance(msg, Token):
            if c.reason is not None:
                return []  # a token after this choice's stop string: already answered
            if self.t_first is None:
                self.t_first = now
                m.observe(m.ttft, now - self.t0)
            elif c.t_last:
                m.observe(m.itl, now - c.t_last)
            c.t_last = now
            m.count(m.tokens)
            c.tokens.append(msg.token)
            c.logprobs.append(msg.logprob)
            c.top.append(msg.top)
            if self.live:
                if c.decoder is not None and self.backend is not None:
                    piece = c.decoder.step(self.backend, msg.token)
                    if piece:
                        self.texts[c.index] += piece
                else:
                    self.texts[c.index] = self.tokenizer.decode(c.tokens, skip_special_tokens=True)
                self._stop_strings(c)
                if c.reason is not None:
                    self.cancel(self.rid, c.index)
        elif isinstance(msg, Finish):
            if c.reason is None:
                c.reason = "stop" if msg.reason == "stop" else msg.reason
                self.left -= 1
                if c.decoder is not None:  # the tokenizer's decode exactly, once, at the end
                    self.texts[c.index] = self.whole(c.tokens)
        elif isinstance(msg, Error) and c.reason is None:
            c.reason, c.error = "error", msg.message
            self.left -= 1
        return [c.index]

    def text(self, index: int) -> str:
        """The choice's whole text (after its end)."""
        if not self.live:
            return self.whole(self.choices[index].tokens)
        return self.texts[index]

    def whole(self, tokens: list[int]) -> str:
        """The tokenizer's decode of these tokens, special ones left out: its backend's decode
        where that is the same (`decodes_incrementally`), without transformers' Python around."""
        if self.backend is not None:
            return self.backend.decode(tokens, skip_special_tokens=True)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _stop_strings(self, c: Choice) -> None:
        text = self.texts[c.index]
        for s in self.job.stops:
            at = text.find(s, max(0, self.sent[c.index] - len(s)))
            if at >= 0:
                self.texts[c.index] = text[:at]
                c.reason = "stop"
                self.left -= 1
                return

    def delta(self, index: int) -> str | None:
        """New text of a choice that can go out now (a possible stop-string start held back)."""
        c = self.choices[index]
        text = self.texts[index]
        end = len(text) if c.reason is not None else len(text) - self.hold
        if c.reason is None and text.endswith("\ufffd"):
            return None  # a multi-byte character is not complete yet
        if end <= self.sent[index]:
            return None if c.reason is None else ""
        out = text[self.sent[index] : end]
        self.sent[index] = end
        return out

    def scored(
        self, index: int, since: int = 0, *, prompt: bool = False, tokens: bool = True
    ) -> tuple[list[int], list[float | None], list[list | None]]:
        """A choice's tokens from `since` on, their log-probabilities and alternatives
        ([(token id, logprob), ...]); `prompt`: the prompt's tokens first (echo with logprobs;
        the first one's log-probability and alternatives None); `tokens` False: the prompt's
        alone (a stream's prompt chunk)."""
        c = self.choices[index]
        end = len(c.tokens) if tokens else since
        ids, lps, tops = c.tokens[since:end], c.logprobs[since:end], c.top[since:end]
        if prompt and c.prompt is not None:
            ids = self.job.ids[self.prompt_index(index)] + ids
            lps, tops = c.prompt.logprobs + lps, c.prompt.top + tops
        return ids, lps, tops

    def usage(self) -> Usage:
        p = sum(len(i) for i in self.job.ids)
        c = sum(len(ch.tokens) for ch in self.choices)
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
