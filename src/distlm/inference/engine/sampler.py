"""The last stage's part: per-lane sampling state, and one forward pass's picks for a micro-batch.

Every sequence owns a `torch.Generator` seeded from its `seed`, so a sampled completion depends
only on (model, prompt, parameters, seed), never on which other prompts share the pipeline.
`pick_token` raises SamplingError when the distribution it would draw from is not finite; a pick
that fails (SamplingError, a bug) carries its error and fails that one sequence only.
"""

from __future__ import annotations

import torch

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.inference.engine.pipeline_stage import StageModel
from distlm.inference.engine.ring import Pick, PipelineError, Slot
from distlm.inference.sampling_params import SamplingParams
from distlm.runtime.device import StreamPoint, host

log = get_logger(__name__)


class SamplingError(DistlmError):
    """Sampling one sequence failed (a non-finite distribution): that sequence fails, no other."""


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
    index = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, index).squeeze(1)
    if n:
        top = torch.topk(lp, min(n, lp.shape[1]), dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [() for _ in targets]
    return tuple(zip(chosen.tolist(), alts))


class Sampler:
    """The last stage's per-lane sampling state (parameters and random generator)."""

    def __init__(self) -> None:
        self.lanes: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}

    def start(self, lane: int, params: SamplingParams) -> None:
        self.lanes[lane] = (params, new_generator(params))

    def release(self, lane: int) -> None:
        self.lanes.pop(lane, None)

    def needs_logits(self, lane: int) -> bool:
        """Whether the lane's pick reads its row of logits (sampling, log-probabilities), not
        the row's argmax alone (greedy)."""
        entry = self.lanes.get(lane)
        return entry is None or not entry[0].greedy or entry[0].logprobs is not None

    def pick(
        self,
        seq: int,
        lane: int,
        logits: torch.Tensor | None,
        prompt=None,
        argmax: int | None = None,
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
                assert logits is not None, "a pick that samples gets its row (needs_logits)"
                token = pick_token(logits, params, gen)
            if params.logprobs is None:
                return Pick(seq, token, prompt=prompt)
            assert logits is not None, "a pick with log-probabilities gets its row"
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
    """Each row's argmax (B, V) -> B picks, for the whole micro-batch at once, on the logits'
    device with one read to the host (what pick_token chooses for a greedy sequence); None for a
    row with no finite logit (pick_token then fails that sequence alone)."""
    return _best(_argmax_flags(logits).tolist(), logits)


def _argmax_flags(logits: torch.Tensor) -> torch.Tensor:
    """(2, B) on the logits' device: each row's max's index and whether that max is finite. max's
    indices are argmax's (the first of equal maxima), and its values say in the same pass
    whether every row has a finite logit (a row's max is NaN when it holds a NaN, and not finite
    when it holds +inf or only -inf); only then are the rows looked at one by one (`_best`)."""
    top = logits.max(dim=1)
    return torch.stack((top.indices, torch.isfinite(top.values).long()))


def _best(flags: list[list[int]], logits: torch.Tensor) -> list[int | None]:
    best, ok = flags
    if all(ok):
        return list[int | None](best)
    finite = torch.isfinite(logits).any(dim=1).tolist()
    return [b if f else None for b, f in zip(best, finite)]


class LastStep:
    """A last stage's micro-batch on its way: its forward pass, and the reads its picks need
    (each row's argmax; the rows a pick reads: sampling, log-probabilities; the prompts' scores)
    queued on the device behind it, to host memory without waiting (`launch_last_stage`).
    `picks()` waits for them alone and picks. On the CPU every read is done when queued.

    With `hold` (a step finished after the next one starts: the engine's steps in flight) the
    logits are kept apart from the model's output, which the next replay of a CUDA graph writes
    again; they are read only for a row with no finite maximum (rare: pick_token's verdict)."""

    def __init__(
        self, model: StageModel, sampler: Sampler, slots: tuple[Slot, ...], x, *, hold: bool
    ) -> None:
        self.sampler, self.slots = sampler, slots
        out = model([sl.item for sl in slots], x, every=_every(slots))
        logits, rest = out if isinstance(out, tuple) else (out, {})
        for sl in slots:  # a prefill's sampling state first: whether its row is needed says it
            if sl.item.pos == 0 and sl.params is not None:
                sampler.start(sl.item.lane, sl.params)
                for f in sl.forks:
                    sampler.start(f.lane, f.params)
        self.logits: torch.Tensor | None = logits.clone() if hold else logits
        self.flags = _argmax_flags(logits).to(host(), non_blocking=True)  # (2, B)
        need = [
            i
            for i, sl in enumerate(slots)
            if sampler.needs_logits(sl.item.lane)
            or any(sampler.needs_logits(f.lane) for f in sl.forks)
        ]
        self.rows = (
            dict(zip(need, logits[need].float().to(host(), non_blocking=True))) if need else {}
        )
        self.prompts = {
            i: rest[i].to(host(), non_blocking=True)
            for i, sl in enumerate(slots)
            if sl.prompt is not None and sl.params is not None
        }
        self.point = StreamPoint(logits.device)

    def picks(self) -> list[Pick]:
        logits = self.logits
        if logits is None:
            raise PipelineError("a micro-batch's picks were taken twice")
        self.point.synchronize()
        best = _best(self.flags.tolist(), logits)
        sampler, rows = self.sampler, self.rows
        for i, b in enumerate(best):  # a row with no finite logit: pick_token's verdict on it
            if b is None and i not in rows:
                rows[i] = logits[i].float().cpu()
        picks = []
        for i, sl in enumerate(self.slots):
            if sl.item.pos == 0 and sl.params is None:  # stage 0 sends them with every prefill
                raise PipelineError(f"sequence {sl.item.seq}: a prefill without its parameters")
            prompt = None
            if i in self.prompts:
                assert sl.params is not None and sl.prompt is not None
                prompt = prompt_logprobs(
                    self.prompts[i], list(sl.prompt[1:]), sl.params.prompt_logprobs or 0
                )
            row = rows.get(i)
            picks.append(sampler.pick(sl.item.seq, sl.item.lane, row, prompt, best[i]))
            picks.extend(sampler.pick(f.seq, f.lane, row, prompt, best[i]) for f in sl.forks)
        self.logits = None  # let go of the device's copy
        return picks


def launch_last_stage(
    model: StageModel, sampler: Sampler, slots: tuple[Slot, ...], x, *, hold: bool = False
) -> LastStep:
    """The last stage's forward pass and the reads its picks need, queued (see LastStep)."""
    return LastStep(model, sampler, slots, x, hold=hold)


def last_stage(model: StageModel, sampler: Sampler, slots: tuple[Slot, ...], x) -> list[Pick]:
    """The last stage's forward pass and picks: one pass scores the prompts that ask for it.
    Greedy rows are picked on the logits' device (their argmax, B numbers to the host); only the
    rows a pick reads (sampling, log-probabilities, a row without a finite logit) come to the
    host, where the generators live."""
    return launch_last_stage(model, sampler, slots, x).picks()


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
