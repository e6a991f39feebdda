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
is a CUDA graph replayed (`DecodeGraphs`, engine/graphs.py). A micro-batch's items and where
its tokens go (the plan, the decode rows' attention) are engine/micro_batch.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.family import ModelArgs, family_of
from distlm.inference.engine.graphs import DecodeGraphs
from distlm.inference.engine.micro_batch import Item, _attend_decode, _Plan
from distlm.model import load_stage_shard, read_args, read_manifest
from distlm.model.documents import ShardEntry
from distlm.runtime.device import DeviceBackend, DeviceClock

__all__ = ["Item", "StageModel", "load_stage"]  # Item: the micro-batch's (engine/micro_batch.py)

log = get_logger(__name__)


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
        self.cut = entry.cut  # blocks [start, end), embeddings (first), head (last)
        self.blocks = family_of(args).build(args, self.cut, device=device, dtype=dtype)
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
        self.clock = DeviceClock(p.device)  # the device's time in this stage's forward passes

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
        if self.cut.first:
            x = blocks.embed(x.to(dev), plan.positions)  # (N, C)
        else:
            x = x.to(dev, self.dtype)  # (N, C)
        rot = blocks.positions(plan.positions, self.dtype)  # per micro-batch (rotary), or None
        for j, block in enumerate(self._blocks):
            q, kv = block.qkv(x, rot)  # (N, n_head, D), (N, 2, n_kv_head, D)
            x = block.finish(x, self._attend(j, plan, q, kv))
        for it in items:
            self.length[it.lane] = it.pos + it.n
        if not self.cut.last:
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
        model.cut.start,
        model.cut.end - 1,
        ", embeddings" if model.cut.first else "",
        ", head" if model.cut.last else "",
        sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
        "; decode steps replayed as CUDA graphs" if model.graphs and hw.capture_graphs else "",
    )
    return model
