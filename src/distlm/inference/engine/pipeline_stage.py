"""One pipeline stage: a range of blocks of distlm's model of its family (`distlm.family`: the
model training and evaluation run), a KV cache per lane.

A stage runs a *micro-batch*: several sequences (each in its own lane) packed along the token axis,
(N, C) with N = sum of the items' new tokens. The per-token work (norms, QKV and output
projections, rotary positions, MLP) is the blocks' own (`Block.qkv`, `Block.finish`) and runs on
the packed tensor; attention is this module's.
The KV cache is one tensor per layer, (lanes, 2, n_kv_head, T + 1, head_dim), grown as lanes and
lengths need (grouped-query attention caches fewer heads than it queries; position T is a
scratch one). Attention is the SDPA call Hugging Face's models make: a prefill attends over its
own new tokens (causal); the decode items of a micro-batch (one new token each) attend together,
in one call, over their lanes' cached keys with a mask of each lane's length, so a sequence's
logits do not depend on which other sequences share its micro-batch, and a decode step costs a
handful of tensor operations per layer whatever the number of sequences. On a GPU a decode step
is a CUDA graph replayed (`DecodeGraphs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
from distlm.device import DeviceBackend, StepGraph
from distlm.documents import ShardEntry
from distlm.family import ModelArgs, family_of
from distlm.log import get_logger
from distlm.model import load_stage_shard, read_args, read_manifest

log = get_logger(__name__)


@dataclass(frozen=True)
class Item:
    """One sequence's slice of a micro-batch: `n` new tokens at positions [pos, pos + n)."""

    seq: int  # sequence id (unique per run)
    lane: int  # KV-cache slot
    pos: int  # position of the first new token; 0 starts the lane afresh (prefill)
    n: int

    @property
    def decode(self) -> bool:
        """One new token after cached ones: what the decode steps batch (eager or as a graph)."""
        return self.n == 1 and self.pos > 0


class StageModel(nn.Module):
    """One pipeline stage: distlm's model of its family for the stage's blocks (embeddings on
    stage 0, blocks [start, end), final norm + LM head on the last stage) and a KV cache per
    lane."""

    def __init__(
        self,
        args: ModelArgs,
        entry: ShardEntry,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        decode_graphs: bool = False,
        capture_graphs: bool = False,
    ) -> None:
        super().__init__()
        self.args = args
        self.stage = entry.stage
        self.start, self.end = entry.layers
        self.first = entry.has_embeddings
        self.last = entry.has_head
        self.blocks = family_of(args).build(
            args,
            start=self.start,
            end=self.end,
            first=self.first,
            last=self.last,
            device=device,
            dtype=dtype,
        )
        self._blocks = self.blocks.blocks  # the block modules, indexed without a call
        self.hidden_size = args.dim  # C
        self.n_head, self.n_kv_head, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.gqa = args.gqa  # SDPA shares each cached head among n_head/n_kv_head
        self.width = args.n_heads * args.head_dim  # attention output per token
        self.context = args.context
        self.scales = [b.scale for b in self._blocks]  # SDPA scale per local layer
        # per local layer: keys and values of every lane, (lanes, 2, n_kv_head, T + 1, head_dim)
        # (keys then values: a step writes both in one operation; position T is a scratch one,
        # never attended: DecodeGraphs' rows without an item write there), grown by _reserve;
        # `length[lane]`: the positions cached for the lane's sequence
        self.kv: list[torch.Tensor] = []
        self.length: dict[int, int] = {}
        self._cache_bytes = 0
        # decode steps as CUDA graphs (the device backend's `decode_graphs`: a GPU's), or None
        self.graphs = DecodeGraphs(self, capture=capture_graphs) if decode_graphs else None
        self._note_placement()

    def _note_placement(self) -> None:
        p = next(self.parameters())
        self._device, self._dtype = p.device, p.dtype

    def _apply(self, fn, recurse=True):
        # .to() / .float() / .cuda() all come here: note where the weights now are, once,
        # instead of finding a parameter in every step
        out = super()._apply(fn, recurse)
        self._note_placement()
        if self.graphs is not None:
            self.graphs.clear()  # they held the weights where they were
        return out

    # ------------------------------------------------------------------ weights

    def load_shard(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """The stage's shard (transformers' names, the manifest's tensors) into its blocks."""
        self.blocks.load_hf(tensors, where)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ forward

    def release(self, lane: int) -> None:
        """The lane's sequence ended: its positions are forgotten; when no lane holds any, the
        cache tensors themselves are freed (an idle stage holds no KV cache; the next prefill
        grows them again). With decode graphs (a GPU) the cache stays, as vLLM's does: the
        graphs hold it, and capturing them again after each idle spell would stall the steps
        after it."""
        self.length.pop(lane, None)
        if not self.length and self.graphs is None:
            self.kv.clear()
            self._cache_bytes = 0

    def cached_bytes(self) -> int:
        """Bytes the KV cache holds now (keys and values of every layer)."""
        return self._cache_bytes

    @torch.inference_mode()  # the cache holds inference tensors (written in forward)
    def fork(self, parent: int, child: int) -> None:
        """`child` continues from `parent`'s cache (n > 1: one prefill for every choice)."""
        n = self.length[parent]
        self._reserve(child, n)
        for cache in self.kv:
            cache[child, :, :, :n] = cache[parent, :, :, :n]
        self.length[child] = n

    def _reserve(self, lane: int, end: int) -> None:
        """Room in the cache for lanes up to `lane` and positions up to `end` (both grown by
        doubling, positions up to the context), so that a step writes in place and admitting
        lanes one by one copies the cache a logarithmic number of times."""
        lanes, T = (self.kv[0].shape[0], self.kv[0].shape[3] - 1) if self.kv else (0, 0)
        if lane < lanes and end <= T:
            return
        new_lanes = max(lanes * 2 if lane >= lanes else lanes, lane + 1)
        new_T = min(max(T * 2, end, 64), self.context)
        if end > new_T:
            raise DistlmError(
                f"stage {self.stage}: position {end} is beyond the context of {new_T} tokens"
            )
        shape = (new_lanes, 2, self.n_kv_head, new_T + 1, self.head_dim)  # + the scratch position
        for j in range(len(self._blocks)):
            grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if j < len(self.kv):
                grown[:lanes, :, :, :T] = self.kv[j][:, :, :, :T]
                self.kv[j] = grown
            else:
                self.kv.append(grown)
        self._cache_bytes = sum(t.numel() * t.element_size() for t in self.kv)
        if self.graphs is not None:
            self.graphs.clear()  # they held the cache before it grew

    @torch.inference_mode()
    def forward(
        self, items: list[Item], x: torch.Tensor, *, every: frozenset[int] = frozenset()
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Stage 0 takes token ids (N,); later stages hidden states (N, C).

        Returns hidden states (N, C), or on the last stage the logits of each item's last token
        (B, V). `every` (last stage): the items (by index) whose every position's logits are
        wanted too (prompt log-probabilities); then (last logits, {index: (n - 1, V) logits of
        the positions before the last}), from the same forward pass.
        """
        dev = self.device
        blocks = self.blocks
        for it in items:
            if it.pos != 0 and self.length.get(it.lane) != it.pos:
                raise DistlmError(
                    f"stage {self.stage}: lane {it.lane} has {self.length.get(it.lane, 0)} "
                    f"cached positions, the step starts at position {it.pos}"
                )
        self._reserve(max(it.lane for it in items), max(it.pos + it.n for it in items))
        graphs = self.graphs
        if graphs is not None and not every and graphs.decode(items):  # a CUDA graph on a GPU
            out = graphs.run(items, x)
            if out is not None:
                for it in items:
                    self.length[it.lane] = it.pos + 1
                return out
            self.graphs = None  # its capture failed (logged): the eager steps from now on
        plan = _Plan(items, dev, self.dtype)
        if self.first:
            x = blocks.embed(x.to(dev), plan.positions)  # (N, C)
        else:
            x = x.to(dev, self.dtype)  # (N, C)
        rot = blocks.positions(plan.positions, self.dtype)  # per micro-batch (rotary), or None
        for j, block in enumerate(self._blocks):
            q, kv = block.qkv(x, rot)  # (N, n_head, D), (N, 2, n_kv_head, D)
            x = block.finish(x, self._attend(j, plan, q, kv))
        for it in items:
            self.length[it.lane] = it.pos + it.n
        if not self.last:
            return x
        if not every and x.shape[0] == len(items):  # one token each: every row is a last one
            return blocks.head(x)  # (B, V)
        starts = torch.tensor([0] + [it.n for it in items]).cumsum(0)
        last = blocks.head(x[(starts[1:] - 1).to(dev)])  # (B, V)
        if not every:
            return last
        rest = {
            i: blocks.head(x[int(starts[i]) : int(starts[i + 1]) - 1])  # (n - 1, V)
            for i in sorted(every)
        }
        return last, rest

    def _attend(self, j: int, plan: _Plan, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Layer j's attention of the new tokens: their keys and values kv (N, 2, n_kv_head, D)
        written into the cache, each token attending over its lane's cached positions up to its
        own -> (N, n_head * D). With grouped-query attention the cache holds n_kv_head heads,
        each shared by n_head / n_kv_head query heads (SDPA's enable_gqa)."""
        W, scale, gqa = self.width, self.scales[j], self.gqa
        cache = self.kv[j]  # (lanes, 2, n_kv_head, T, D)
        K, V = cache[:, 0], cache[:, 1]  # (lanes, n_kv_head, T, D) each, views
        if plan.single is not None:  # one sequence: slices, no index tensors, no mask
            it = plan.single
            end = it.pos + it.n
            cache[it.lane, :, :, it.pos : end] = kv.permute(1, 2, 0, 3)  # (2, n_kv_head, n, D)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),  # (1, n_head, n, D)
                K[it.lane : it.lane + 1, :, :end],
                V[it.lane : it.lane + 1, :, :end],
                scale=scale,
                is_causal=it.n > 1 and it.pos == 0,
                attn_mask=None
                if it.n == 1 or it.pos == 0
                else torch.ones(it.n, end, dtype=torch.bool, device=q.device).tril(it.pos),
                enable_gqa=gqa,
            )
            return o[0].transpose(0, 1).reshape(it.n, W)
        cache[plan.lanes, :, :, plan.positions] = kv  # every new token's key and value, in place
        d = plan.decode
        if d is not None and d.whole:  # item i is token i and cache row lo + i: as they are
            return _attend_decode(d, q.unsqueeze(2), K, V, scale, gqa).reshape(-1, W)
        a = torch.empty(q.shape[0], W, dtype=q.dtype, device=q.device)  # (N, n_head * D)
        if d is not None:
            # each row's query (R, n_head, D): the items' own when aligned, else picked by row
            qd = q[: d.R] if d.aligned else q.index_select(0, d.src)
            o = _attend_decode(d, qd.unsqueeze(2), K, V, scale, gqa).reshape(-1, W)
            if not d.aligned:
                o = o.index_select(0, d.at)  # (B, n_head * D): each item's row
            if d.first:
                a[: d.B] = o
            else:
                a[d.rows] = o
        for off, it in plan.others:
            qi = q[off : off + it.n].transpose(0, 1).unsqueeze(0)  # (1, n_head, n, D)
            end = it.pos + it.n
            ki = K[it.lane : it.lane + 1, :, :end]  # (1, n_kv_head, end, D)
            vi = V[it.lane : it.lane + 1, :, :end]
            mask = None
            if it.pos:  # new tokens after cached ones: each sees the cache and its own past
                mask = torch.ones(it.n, end, dtype=torch.bool, device=q.device).tril(it.pos)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, is_causal=mask is None, enable_gqa=gqa
            )
            a[off : off + it.n] = o[0].transpose(0, 1).reshape(it.n, W)
        return a


def _attend_decode(
    d: _Decode, qd: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    """The decode rows' queries qd (R, n_head, 1, D) over their cache rows -> (R, n_head, 1, D)."""
    if d.lanes is None:  # the cache rows [lo, lo + R) in place: a view, nothing copied
        Kd, Vd = K[d.lo : d.lo + d.R, :, : d.T], V[d.lo : d.lo + d.R, :, : d.T]
    else:  # lanes spread out: their rows gathered
        Kd, Vd = K[d.lanes, :, : d.T], V[d.lanes, :, : d.T]
    return F.scaled_dot_product_attention(qd, Kd, Vd, attn_mask=d.mask, scale=scale, enable_gqa=gqa)


class _Plan:
    """Where a micro-batch's tokens go: cache rows, and the decode items attended together."""

    def __init__(self, items: list[Item], dev, dtype: torch.dtype = torch.float32) -> None:
        self.single = items[0] if len(items) == 1 else None
        if self.single is not None:
            it = self.single  # each new token's position (N,), for embeddings and rotary
            self.positions = torch.arange(it.pos, it.pos + it.n, device=dev)
            return
        lanes: list[int] = []
        positions: list[int] = []
        decode: list[tuple[int, Item]] = []
        self.others: list[tuple[int, Item]] = []
        off = 0
        for it in items:
            if it.decode:
                decode.append((off, it))
                lanes.append(it.lane)
                positions.append(it.pos)
            else:
                self.others.append((off, it))
                lanes += [it.lane] * it.n
                positions += range(it.pos, it.pos + it.n)
            off += it.n
        # one tensor made for both (each torch.tensor call costs microseconds a step)
        self.lanes, self.positions = torch.tensor([lanes, positions], device=dev).unbind(0)
        self.decode = _Decode(decode, dev, dtype, whole=not self.others) if decode else None


class _Decode:
    """The decode items of a micro-batch (one new token each), attended together in one SDPA
    call: a batch of R rows over T cached positions, each row masked to its lane's length.

    When the items' lanes lie close together (the scheduler hands out the lowest lanes first and
    reuses freed ones, so they do while one stage serves), the rows are the cache's own rows
    lo..lo + R - 1, read in place; a row whose lane has no item here attends position 0 with
    another item's query, its output unused. Else the rows are the items' lanes, gathered (a
    copy of their keys and values per layer).

    The mask is additive (0 where a row attends, -inf elsewhere), made once for every layer of
    the step: SDPA turns a boolean mask into exactly this one in each call."""

    def __init__(self, decode: list[tuple[int, Item]], dev, dtype, *, whole: bool) -> None:
        self.B = B = len(decode)
        lanes = [it.lane for _, it in decode]
        rows = [o for o, _ in decode]  # the items' tokens in the micro-batch
        self.T = max(it.pos for _, it in decode) + 1
        self.lo = min(lanes)
        self.R = max(lanes) - self.lo + 1
        self.lanes: torch.Tensor | None = None  # None: the rows lo..lo + R - 1, in place
        if self.R > 2 * B:  # too sparse: attending every row between them would cost more
            self.R, self.lanes = B, torch.tensor(lanes, device=dev)
            at = list(range(B))
        else:
            at = [lane - self.lo for lane in lanes]
        # `first`: the items are the micro-batch's first B tokens (the scheduler launches decodes
        # first, by lane); `aligned`: and on lanes lo, lo + 1, ... in order, so item i is token
        # i and row i, its query and output taken as they lie; `whole`: and nothing else is in it
        self.first = rows == list(range(B))
        self.aligned = self.first and self.lanes is None and self.R == B and at == list(range(B))
        self.whole = whole and self.aligned
        ends = [1] * self.R  # a row with no item here attends position 0 (output unused)
        src = [rows[0]] * self.R  # each row's query: its item's token (any, for a row without)
        for row, o, (_, it) in zip(at, rows, decode):
            ends[row] = it.pos + 1
            src[row] = o
        if not self.aligned:
            self.src = torch.tensor(src, device=dev)  # (R,)
            self.at = torch.tensor(at, device=dev)  # (B,) each item's row
        if not self.first:
            self.rows = torch.tensor(rows, device=dev)  # (B,)
        beyond = torch.arange(self.T, device=dev) >= torch.tensor(ends, device=dev).unsqueeze(1)
        mask = torch.zeros(self.R, self.T, dtype=dtype, device=dev).masked_fill_(beyond, -torch.inf)
        self.mask = mask[:, None, None, :]  # (R, 1, 1, T): each row's length


class DecodeGraphs:
    """Decode steps as CUDA graphs, one per block of cache rows, as vLLM captures its decode
    batches.

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
    - **Every cached position.** Each row attends the cache's T positions with an additive mask
      of its own length (0 up to its position, -inf after), the mask the eager step makes for
      its longest item's length.
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

    def __init__(self, model: StageModel, *, capture: bool) -> None:
        self.model = model
        self.capture = capture  # as CUDA graphs (the device backend's `capture_graphs`)
        self._steps: dict[tuple[int, int], StaticStep] = {}
        self.captured = 0  # graphs captured so far (the log and the tests read it)

    def blocks(self) -> list[tuple[int, int]]:
        """The blocks of rows (lo, R) that have a step now."""
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

    def run(self, items: list[Item], x: torch.Tensor) -> torch.Tensor | None:
        """The decode step of `items` (token ids (B,) on stage 0, hidden states (B, C) after)
        in its static step -> hidden states (B, C), or logits (B, V) on the last stage, in the
        items' order; None when the step's capture failed (logged; nothing was computed that
        the eager step would not write the same)."""
        lo, R = self.block(items)
        step = self._steps.get((lo, R))
        if step is None:
            step = self._steps[lo, R] = StaticStep(self.model, lo, R)
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
    """One block's decode step over the cache's rows [lo, lo + R), its shapes and tensors fixed
    (DecodeGraphs' doc); `forward` is what a CUDA graph captures."""

    def __init__(self, model: StageModel, lo: int, rows: int) -> None:
        self.model = model
        dev, R = model.device, rows
        self.lo, self.R = lo, R
        self.T = model.kv[0].shape[3] - 1  # the positions rows attend; index T is the scratch
        long = {"dtype": torch.long, "device": dev}
        self.lanes = torch.arange(lo, lo + R, **long)
        self.span = torch.arange(self.T, **long)
        self.pos = torch.zeros(R, **long)  # each row's new position (0: a row without an item)
        self.write = torch.full((R,), self.T, **long)  # where each row's key and value go
        self.mask = torch.zeros(R, 1, 1, self.T, dtype=model.dtype, device=dev)
        # the rows' token ids (stage 0) or hidden states (R, C) (later stages)
        self.x = (
            torch.zeros(R, **long)
            if model.first
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
        self.write.fill_(self.T).index_copy_(0, rows, pos)
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
        h = b.embed(self.x, self.pos) if m.first else self.x
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
        return b.head(h) if m.last else h

    def capture(self) -> None:
        """`forward` captured as a CUDA graph on the model's device (distlm.device's
        `StepGraph`, after one run outside it that writes what the first replay does: the same
        keys and values into the same places)."""
        self.graph = StepGraph(self.model.device, self.forward)

    def replay(self) -> torch.Tensor:
        """`forward`'s output, by replaying its graph (`capture` first): valid until the next
        replay, which writes the same tensor."""
        if self.graph is None:
            raise RuntimeError("StaticStep.replay before capture")
        return self.graph.replay()


def load_stage(
    folder: str | Path, stage: int, *, world: int, hw: DeviceBackend | None = None
) -> StageModel:
    """This rank's stage from a model folder's shards (sha256 checked against the manifest), on
    the device backend's device with its kernels (the CPU's when `hw` is None)."""
    hw = hw or DeviceBackend.cpu()
    device = hw.device
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.stages != world:
        raise DistlmError(
            f"{folder}/shards/manifest.json has {manifest.stages} stage shards but the pipeline "
            f"runs {world} ranks: launch one rank per shard (inference.stages for batch "
            "inference, serve.stages for serve)"
        )
    entry, tensors = load_stage_shard(folder, stage)  # sha256 checked first: fail before building
    args = read_args(folder)
    model = StageModel(
        args,
        entry,
        device=device,
        dtype=next(iter(tensors.values())).dtype,  # the shard's
        decode_graphs=hw.decode_graphs,
        capture_graphs=hw.capture_graphs,
    )
    model.load_shard(tensors, f"{folder}/shards/{entry.file}")
    log.info(
        "pipeline stage %d on %s: layers %d-%d%s%s, %.1f MB%s",
        stage,
        device,
        model.start,
        model.end - 1,
        ", embeddings" if model.first else "",
        ", head" if model.last else "",
        sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
        "; decode steps replayed as CUDA graphs" if model.graphs and hw.capture_graphs else "",
    )
    return model
