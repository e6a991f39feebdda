"""Decode steps as CUDA graphs (`DecodeGraphs`), one per block of cache rows and span of
positions, each a static step (`StaticStep`) with fixed shapes and tensors over the stage's KV
cache: what a pipeline stage (engine/pipeline_stage.py's `StageModel`) replays on a GPU in place
of its eager decode step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from distlm.core.log import get_logger
from distlm.family.table import Cut
from distlm.runtime.device import StepGraph

if TYPE_CHECKING:
    from distlm.family.transformer import Block, Transformer
    from distlm.inference.engine.micro_batch import Item

log = get_logger(__name__)

# the fewest positions a static step attends (DecodeGraphs.span): the smallest bucket
MIN_SPAN = 32


class CachedStage(Protocol):
    """What a static step reads of its pipeline stage (`StageModel`): its blocks and their
    attention's constants, its KV cache, where it runs."""

    stage: int
    cut: Cut  # first: holds the embeddings (its inputs are token ids); last: the head (logits)
    hidden_size: int
    width: int  # attention's output a token
    gqa: bool
    scales: list[float]  # SDPA's scale, a block
    kv: list[torch.Tensor]  # a block's cache, (lanes, 2, n_kv_head, T + 1, D)
    blocks: Transformer
    _blocks: list[Block]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


class DecodeGraphs:
    """Decode steps as CUDA graphs, one per block of cache rows and span of positions, as vLLM
    captures its decode batches.

    A decode step (every item of a micro-batch one new token after cached ones) is a few hundred
    small kernels; on a GPU it is bound by launching them, not by computing them. Captured once
    as a CUDA graph, a step is one launch. A graph replays fixed kernels on fixed memory, so the
    step it captures has fixed shapes and addresses (`StaticStep`):

    - **Rows, not items.** It runs R rows of the KV cache, lanes lo..lo + R - 1, each row the
      item on that lane: R a power of two, lo a multiple of R (buddy blocks), the smallest such
      block that holds the step's lanes, within the cache's (the scheduler hands out the lowest
      lanes first, and a pipeline's micro-batches take blocks of lanes, so the blocks are few).
      A row whose lane has no item here attends position 0 (its output unused) and writes its
      key and value into the cache's scratch position (the last one, which no row ever attends:
      `StageModel._reserve`), never over another sequence's.
    - **The positions in use, in buckets.** Each row attends the step's first T positions with
      an additive mask of its own length (0 up to its position, -inf after), the mask the eager
      step makes for its longest item's length. T is that longest item's length rounded up to
      a power of two, at least `MIN_SPAN`, at most the cache's positions: a block has a step
      per T, and as its sequences grow it captures the next one (at most log2(context /
      MIN_SPAN) + 1 a block). A served cache keeps the positions its longest sequence needed,
      so attending all of them read many times the positions the rows held (benchmarks/LOG.md,
      "The static decode step's positions").
    - **Inputs in place.** The step's token ids (or hidden states, after stage 0), positions,
      write positions and mask are copied into the step's own tensors before each replay; its
      output rows are picked in the items' order after it.

    A graph holds the cache's and the weights' addresses: when the cache grows or the weights
    move (`StageModel._reserve`, `_apply`), every graph is dropped (`clear`) and the next decode
    step of a block captures again. A capture that fails is logged and the stage's decode steps
    stay eager from then on (`run` returns None): a server keeps serving.

    The step is device-neutral: the same tensor operations as the eager step (the family's
    blocks, SDPA), with fixed shapes. Only the capture is CUDA's; on the CPU
    (tests/test_decode_graphs.py) the static step runs as it is, so its numerics are checked
    there against the eager step. The device backend decides whether a stage has them
    (`DeviceBackend.decode_graphs`: on a GPU).
    """

    def __init__(self, model: CachedStage, *, capture: bool) -> None:
        self.model = model
        self.capture = capture  # as CUDA graphs (the device backend's `capture_graphs`)
        self._steps: dict[tuple[int, int, int], StaticStep] = {}  # (lo, R, T) -> its step
        self.captured = 0  # graphs captured so far (the log and the tests read it)

    def blocks(self) -> list[tuple[int, int]]:
        """The blocks of rows (lo, R) that have a step now."""
        return sorted({(lo, R) for lo, R, _ in self._steps})

    def steps(self) -> list[tuple[int, int, int]]:
        """The steps there are now: their rows and positions (lo, R, T)."""
        return sorted(self._steps)

    def clear(self) -> None:
        """Drop every step: the cache or the weights they captured moved."""
        self._steps.clear()

    @staticmethod
    def decode(items: list[Item]) -> bool:
        """Whether `items` are a decode step (each one new token after cached ones)."""
        return all(it.decode for it in items)

    def block(self, items: list[Item]) -> tuple[int, int]:
        """The rows (lo, R) of the static step of `items`: the smallest block of R lanes (a power
        of two) at a multiple of R that holds their lanes, within the cache's lanes."""
        lanes = self.model.kv[0].shape[0]
        a = min(it.lane for it in items)
        b = max(it.lane for it in items)
        R = 1 << (b - a).bit_length()  # the smallest power of two above b - a
        while a // R != b // R:  # the block at a multiple of R must hold both
            R *= 2
        lo = a // R * R
        if lo + R > lanes:  # past the cache's lanes: the block of its last R lanes
            R = min(R, lanes)
            lo = lanes - R
        return lo, R

    def span(self, items: list[Item]) -> int:
        """The positions T the static step of `items` attends: their longest item's length
        (its new position included) rounded up to a power of two, at least MIN_SPAN, at most the
        cache's positions."""
        need = max(it.pos for it in items) + 1
        return min(self.model.kv[0].shape[3] - 1, max(MIN_SPAN, 1 << (need - 1).bit_length()))

    def run(self, items: list[Item], x: torch.Tensor) -> torch.Tensor | None:
        """The decode step of `items` (token ids (B,) on stage 0, hidden states (B, C) after)
        in its static step -> hidden states (B, C), or logits (B, V) on the last stage, in the
        items' order; None when the step's capture failed (logged; nothing was computed that
        the eager step would not write the same)."""
        lo, R = self.block(items)
        T = self.span(items)
        step = self._steps.get((lo, R, T))
        if step is None:
            step = self._steps[lo, R, T] = StaticStep(self.model, lo, R, T)
        rows = step.load(items, x)
        if not self.capture:  # no graphs: the static step as it is
            return step.forward().index_select(0, rows)
        if step.graph is None:
            t0 = time.perf_counter()
            try:
                step.capture()
            except RuntimeError as e:  # torch's CUDA errors, out of memory among them
                log.warning(
                    "stage %d: decode steps stay eager: capturing the step of lanes %d-%d as a "
                    "CUDA graph failed: %s",
                    self.model.stage,
                    lo,
                    lo + R - 1,
                    e,
                )
                self.clear()
                return None
            self.captured += 1
            log.debug(
                "stage %d: the decode step of lanes %d-%d over %d positions captured in %.0f ms",
                self.model.stage,
                lo,
                lo + R - 1,
                step.T,
                (time.perf_counter() - t0) * 1e3,
            )
        return step.replay().index_select(0, rows)


class StaticStep:
    """One block's decode step over the cache's rows [lo, lo + R) and its first T positions,
    its shapes and tensors fixed (DecodeGraphs' doc); `forward` is what a CUDA graph captures."""

    def __init__(self, model: CachedStage, lo: int, rows: int, positions: int) -> None:
        self.model = model
        dev, R = model.device, rows
        self.lo, self.R = lo, R
        self.T = positions  # the positions rows attend
        self.scratch = model.kv[0].shape[3] - 1  # the cache's last position, never attended
        long = {"dtype": torch.long, "device": dev}
        self.lanes = torch.arange(lo, lo + R, **long)
        self.span = torch.arange(self.T, **long)
        self.pos = torch.zeros(R, **long)  # each row's new position (0: a row without an item)
        self.write = torch.full((R,), self.scratch, **long)  # where each row's key and value go
        self.mask = torch.zeros(R, 1, 1, self.T, dtype=model.dtype, device=dev)
        # the rows' token ids (stage 0) or hidden states (R, C) (later stages)
        self.x = (
            torch.zeros(R, **long)
            if model.cut.first
            else torch.zeros(R, model.hidden_size, dtype=model.dtype, device=dev)
        )
        # `forward` as a CUDA graph (`capture`)
        self.graph: StepGraph | None = None

    def load(self, items: list[Item], x: torch.Tensor) -> torch.Tensor:
        """The step's inputs into this step's tensors, in place; returns the items' rows (B,)."""
        dev = self.model.device
        # one tensor made for both (each torch.tensor call costs microseconds a step)
        rows, pos = torch.tensor(
            [[it.lane - self.lo for it in items], [it.pos for it in items]], device=dev
        )
        self.pos.zero_().index_copy_(0, rows, pos)
        self.write.fill_(self.scratch).index_copy_(0, rows, pos)
        self.x.index_copy_(0, rows, x.to(dev, self.x.dtype))
        # each row attends its cached positions up to its own (a row without one: position 0)
        beyond = (self.span > self.pos.unsqueeze(1))[:, None, None, :]  # (R, 1, 1, T)
        self.mask.zero_().masked_fill_(beyond, -torch.inf)
        return rows

    def forward(self) -> torch.Tensor:
        """The stage's layers over the R rows, as the eager decode step computes them: hidden
        states (R, C), or logits (R, V) on the last stage."""
        m, b = self.model, self.model.blocks
        lo, R, T = self.lo, self.R, self.T
        h = b.embed(self.x, self.pos) if m.cut.first else self.x
        rot = b.positions(self.pos, m.dtype)
        for j, block in enumerate(m._blocks):
            q, kv = block.qkv(h, rot)  # (R, n_head, D), (R, 2, n_kv_head, D)
            cache = m.kv[j]  # (lanes, 2, n_kv_head, T + 1, D)
            cache[self.lanes, :, :, self.write] = kv  # rows without an item: the scratch position
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2),  # (R, n_head, 1, D)
                cache[lo : lo + R, 0, :, :T],
                cache[lo : lo + R, 1, :, :T],
                attn_mask=self.mask,
                scale=m.scales[j],
                enable_gqa=m.gqa,
            )
            h = block.finish(h, o.reshape(R, m.width))
        return b.head(h) if m.cut.last else h

    def capture(self) -> None:
        """`forward` captured as a CUDA graph on the model's device (distlm.runtime.device's
        `StepGraph`, after one run outside it that writes what the first replay does: the same
        keys and values into the same places)."""
        self.graph = StepGraph(self.model.device, self.forward)

    def replay(self) -> torch.Tensor:
        """`forward`'s output, by replaying its graph (`capture` first): valid until the next
        replay, which writes the same tensor."""
        if self.graph is None:
            raise RuntimeError("StaticStep.replay before capture")
        return self.graph.replay()
