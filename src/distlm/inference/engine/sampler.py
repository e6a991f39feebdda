"""The last stage's part: per-lane sampling state, and one forward pass's picks for a micro-batch.

A pick that fails (SamplingError, a bug) carries its error and fails that one sequence only.
"""

from __future__ import annotations

import torch

from distlm.inference.engine.pipeline_stage import StageModel
from distlm.inference.engine.ring import Pick, PipelineError, Slot
from distlm.inference.sampling import (
    SamplingParams,
    new_generator,
    pick_token,
    prompt_logprobs,
    top_logprobs,
)
from distlm.log import get_logger

log = get_logger(__name__)


class Sampler:
    """The last stage's per-lane sampling state (parameters and random generator)."""

    def __init__(self) -> None:
        self.lanes: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}

    def start(self, lane: int, params: SamplingParams) -> None:
        self.lanes[lane] = (params, new_generator(params))

    def release(self, lane: int) -> None:
        self.lanes.pop(lane, None)

    def pick(
        self, seq: int, lane: int, logits: torch.Tensor, prompt=None, argmax: int | None = None
    ) -> Pick:
        """A token for one sequence; an error in it (SamplingError, a bug) fails that one only.

        `prompt`: the prompt's log-probabilities (sampling.prompt_logprobs) to carry back;
        `argmax`: the row's argmax when its logits are finite, taken for the whole micro-batch
        at once (what pick_token would choose for a greedy sequence)."""
        try:
            params, gen = self.lanes[lane]
            if params.greedy and argmax is not None:
                token = argmax
            else:
                token = pick_token(logits, params, gen)
            if params.logprobs is None:
                return Pick(seq, token, prompt=prompt)
            lp, top = top_logprobs(logits, token, params.logprobs)
            return Pick(seq, token, lp, tuple(top), prompt=prompt)
        except Exception as e:
            log.error("sequence %d (lane %d): sampling failed: %s", seq, lane, e)
            return Pick(seq, error=f"sampling failed: {e}")


def _every(slots: tuple[Slot, ...]) -> frozenset[int]:
    """The slots whose every position the last stage scores: prefills asking for the prompt's
    log-probabilities."""
    return frozenset(i for i, sl in enumerate(slots) if sl.prompt is not None)


def row_argmax(logits: torch.Tensor) -> list[int | None]:
    """Each row's argmax (B, V) -> B picks, for the whole micro-batch at once (what pick_token
    chooses for a greedy sequence); None for a row with no finite logit (pick_token then fails
    that sequence alone). max's indices are argmax's (the first of equal maxima) from a faster
    CPU kernel, and its values say in the same pass whether every row has a finite logit (a row's
    max is NaN when it holds a NaN, and not finite when it holds +inf or only -inf); only then
    are the rows looked at one by one."""
    top = logits.max(dim=1)
    if bool(torch.isfinite(top.values).all()):
        return top.indices.tolist()
    finite = torch.isfinite(logits).any(dim=1).tolist()
    return [b if ok else None for b, ok in zip(top.indices.tolist(), finite)]


def last_stage(model: StageModel, sampler: Sampler, slots: tuple[Slot, ...], x) -> list[Pick]:
    """The last stage's forward pass and picks: one pass scores the prompts that ask for it."""
    out = model([sl.item for sl in slots], x, every=_every(slots))
    logits, rest = out if isinstance(out, tuple) else (out, {})
    logits = logits.float().cpu()  # (B, V); the generators live on the CPU
    best = row_argmax(logits)
    picks = []
    for i, sl in enumerate(slots):
        if sl.item.pos == 0:
            if sl.params is None:  # stage 0 sends them with every prefill (scheduler._slots)
                raise PipelineError(f"sequence {sl.item.seq}: a prefill without its parameters")
            sampler.start(sl.item.lane, sl.params)
            for f in sl.forks:
                sampler.start(f.lane, f.params)
        prompt = None
        if sl.prompt is not None and sl.params is not None:
            prompt = prompt_logprobs(
                rest[i].cpu(), list(sl.prompt[1:]), sl.params.prompt_logprobs or 0
            )
        picks.append(sampler.pick(sl.item.seq, sl.item.lane, logits[i], prompt, best[i]))
        picks.extend(sampler.pick(f.seq, f.lane, logits[i], prompt, best[i]) for f in sl.forks)
    return picks


def fork_caches(model: StageModel, slots: tuple[Slot, ...]) -> None:
    """After a prefill, each fork's lane gets the parent's KV cache (n > 1 shares the prefill)."""
    for sl in slots:
        for f in sl.forks:
            model.fork(sl.item.lane, f.lane)


def release_lanes(model: StageModel, sampler: Sampler | None, lanes: tuple[int, ...]) -> None:
    """Free the KV cache (and on the last stage the sampling state) of lanes whose sequences ended."""
    for lane in lanes:
        model.release(lane)
        if sampler is not None:
            sampler.release(lane)
