"""One pipeline stage: its transformer blocks (transformers' GPT2Block), a KV cache per lane.

A stage runs a *micro-batch*: several sequences (each in its own lane) packed along the token axis,
(1, N, C) with N = sum of the items' new tokens. The per-token work (layer norms, QKV and output
projections, MLP) runs on the packed tensor. The KV cache is one tensor per layer,
(lanes, n_head, T, head_dim), grown as lanes and lengths need. Attention is the SDPA call
Hugging Face's GPT-2 makes: a prefill attends over its own new tokens (causal); the decode items
of a micro-batch (one new token each) attend together, in one call, over their lanes' cached
keys with a mask of each lane's length, so a sequence's logits do not depend on which other
sequences share its micro-batch, and a decode step costs a handful of tensor operations per
layer whatever the number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
from distlm.documents import ShardEntry
from distlm.log import get_logger
from distlm.model import check_state_dict, load_config_json, load_stage_shard, read_manifest

log = get_logger(__name__)


@dataclass(frozen=True)
class Item:
    """One sequence's slice of a micro-batch: `n` new tokens at positions [pos, pos + n)."""

    seq: int  # sequence id (unique per run)
    lane: int  # KV-cache slot
    pos: int  # position of the first new token; 0 starts the lane afresh (prefill)
    n: int


class StageModel(nn.Module):
    """Embeddings (stage 0), blocks [start, end), final norm + LM head (last stage)."""

    def __init__(self, config, entry: ShardEntry) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config._attn_implementation = "sdpa"
        self.config = config
        self.stage = entry.stage
        self.start, self.end = entry.layers
        self.first = entry.has_embeddings
        self.last = entry.has_head
        C = config.n_embd
        if self.first:
            self.wte = nn.Embedding(config.vocab_size, C)
            self.wpe = nn.Embedding(config.n_positions, C)
        self.h = nn.ModuleList(GPT2Block(config, layer_idx=i) for i in range(self.start, self.end))
        if self.last:
            self.ln_f = nn.LayerNorm(C, eps=config.layer_norm_epsilon)
            self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.n_head = config.n_head
        self.head_dim = C // config.n_head
        self.scales = []
        for i in range(self.start, self.end):
            s = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                s /= float(i + 1)
            self.scales.append(s)
        # per local layer: keys and values of every lane, (lanes, n_head, T, head_dim), grown by
        # _reserve; `length[lane]`: the positions cached for the lane's sequence
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length: dict[int, int] = {}

    # ------------------------------------------------------------------ weights

    def _local_name(self, name: str) -> str:
        if name.startswith("transformer.h."):
            layer, rest = name[len("transformer.h.") :].split(".", 1)
            return f"h.{int(layer) - self.start}.{rest}"
        if name.startswith("transformer."):
            return name[len("transformer.") :]
        return name

    def load_shard(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        sd = {self._local_name(k): v for k, v in tensors.items()}
        check_state_dict(sd, self.state_dict(), where)
        dtype = next(iter(sd.values())).dtype
        self.to(dtype)
        self.load_state_dict(sd, strict=True)
        self.eval()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ------------------------------------------------------------------ forward

    def release(self, lane: int) -> None:
        """The lane's sequence ended: its positions are forgotten; when no lane holds any, the
        cache tensors themselves are freed (an idle stage holds no KV cache; the next prefill
        grows them again)."""
        self.length.pop(lane, None)
        if not self.length:
            self.keys.clear()
            self.values.clear()

    def cached_bytes(self) -> int:
        """Bytes the KV cache holds now (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @torch.inference_mode()  # the cache holds inference tensors (written in forward)
    def fork(self, parent: int, child: int) -> None:
        """`child` continues from `parent`'s cache (n > 1: one prefill for every choice)."""
        n = self.length[parent]
        self._reserve(child, n)
        for cache in (*self.keys, *self.values):
            cache[child, :, :n] = cache[parent, :, :n]
        self.length[child] = n

    def _reserve(self, lane: int, end: int) -> None:
        """Room in the cache for `lane` up to position `end` (grown by doubling, up to the
        context), so that a step writes in place."""
        lanes, T = (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)
        if lane < lanes and end <= T:
            return
        new_lanes = max(lanes, lane + 1)
        new_T = min(max(T * 2, end, 64), self.config.n_positions)
        if end > new_T:
            raise DistlmError(
                f"stage {self.stage}: position {end} is beyond the context of {new_T} tokens"
            )
        shape = (new_lanes, self.n_head, new_T, self.head_dim)
        for caches in (self.keys, self.values):
            for j in range(len(self.h)):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if caches is not None and j < len(caches):
                    grown[:lanes, :, :T] = caches[j]
                    caches[j] = grown
                else:
                    caches.append(grown)

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
        if self.first:
            positions = torch.cat([torch.arange(it.pos, it.pos + it.n) for it in items]).to(dev)
            x = self.wte(x.to(dev)) + self.wpe(positions)  # (N, C)
        else:
            x = x.to(dev, self.dtype)  # (N, C)
        for it in items:
            if it.pos != 0 and self.length.get(it.lane) != it.pos:
                raise DistlmError(
                    f"stage {self.stage}: lane {it.lane} has {self.length.get(it.lane, 0)} "
                    f"cached positions, the step starts at position {it.pos}"
                )
            self._reserve(it.lane, it.pos + it.n)
        plan = _Plan(items, dev)
        for j, block in enumerate(self.h):
            x = self._block(j, block, plan, x)
        for it in items:
            self.length[it.lane] = it.pos + it.n
        if not self.last:
            return x
        x = self.ln_f(x)
        starts = torch.tensor([0] + [it.n for it in items]).cumsum(0)
        last = self.lm_head(x[(starts[1:] - 1).to(dev)])  # (B, V)
        if not every:
            return last
        rest = {
            i: self.lm_head(x[int(starts[i]) : int(starts[i + 1]) - 1])  # (n - 1, V)
            for i in sorted(every)
        }
        return last, rest

    def _block(self, j: int, block, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
        """GPT2Block's computation on (N, C), its modules' weights used through the functional
        operations they call (the same kernels, without a module call each)."""
        attn = block.attn
        C = x.shape[-1]
        nh, hd = self.n_head, self.head_dim
        residual = x
        qkv = _conv1d(attn.c_attn, _layer_norm(block.ln_1, x))  # (N, 3C)
        q, k, v = (t.view(-1, nh, hd) for t in qkv.split(C, dim=1))  # (N, nh, hd) each
        K, V = self.keys[j], self.values[j]  # (lanes, nh, T, hd)
        if plan.single is not None:  # one sequence: slices, no index tensors, no mask
            it = plan.single
            end = it.pos + it.n
            K[it.lane, :, it.pos : end] = k.transpose(0, 1)
            V[it.lane, :, it.pos : end] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, hd)
                K[it.lane : it.lane + 1, :, :end],
                V[it.lane : it.lane + 1, :, :end],
                scale=self.scales[j],
                is_causal=it.n > 1 and it.pos == 0,
                attn_mask=None
                if it.n == 1 or it.pos == 0
                else torch.ones(it.n, end, dtype=torch.bool, device=x.device).tril(it.pos),
            )
            a = o[0].transpose(0, 1).reshape(it.n, C)
            return self._mlp(block, residual + _conv1d(attn.c_proj, a))
        K[plan.lanes, :, plan.positions] = k  # every new token's key and value, in place
        V[plan.lanes, :, plan.positions] = v
        a = torch.empty(x.shape[0], C, dtype=x.dtype, device=x.device)  # (N, C)
        if plan.decode is not None:
            rows, lanes, mask, T = plan.decode
            qd = q[rows].unsqueeze(2)  # (B, nh, 1, hd)
            o = F.scaled_dot_product_attention(
                qd, K[lanes, :, :T], V[lanes, :, :T], attn_mask=mask, scale=self.scales[j]
            )  # (B, nh, 1, hd)
            a[rows] = o.reshape(-1, C)
        for off, it in plan.others:
            qi = q[off : off + it.n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
            end = it.pos + it.n
            ki = K[it.lane : it.lane + 1, :, :end]  # (1, nh, end, hd)
            vi = V[it.lane : it.lane + 1, :, :end]
            mask = None
            if it.pos:  # new tokens after cached ones: each sees the cache and its own past
                mask = torch.ones(it.n, end, dtype=torch.bool, device=x.device).tril(it.pos)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=self.scales[j], is_causal=mask is None
            )
            a[off : off + it.n] = o[0].transpose(0, 1).reshape(it.n, C)
        return self._mlp(block, residual + _conv1d(attn.c_proj, a))

    @staticmethod
    def _mlp(block, x: torch.Tensor) -> torch.Tensor:
        mlp = block.mlp
        return x + _conv1d(mlp.c_proj, mlp.act(_conv1d(mlp.c_fc, _layer_norm(block.ln_2, x))))


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _conv1d(c, x: torch.Tensor) -> torch.Tensor:
    """transformers' Conv1D (a linear layer with its weight transposed) on (N, in)."""
    return torch.addmm(c.bias, x, c.weight)


class _Plan:
    """Where a micro-batch's tokens go: cache rows, and the decode items attended together."""

    def __init__(self, items: list[Item], dev) -> None:
        self.single = items[0] if len(items) == 1 else None
        if self.single is not None:
            return
        lanes, positions, offs = [], [], []
        off = 0
        for it in items:
            lanes += [it.lane] * it.n
            positions += range(it.pos, it.pos + it.n)
            offs.append(off)
            off += it.n
        self.lanes = torch.tensor(lanes, device=dev)
        self.positions = torch.tensor(positions, device=dev)
        decode = [(o, it) for o, it in zip(offs, items) if it.n == 1 and it.pos > 0]
        self.others = [(o, it) for o, it in zip(offs, items) if not (it.n == 1 and it.pos > 0)]
        self.decode = None
        if decode:
            T = max(it.pos for _, it in decode) + 1
            ends = torch.tensor([it.pos + 1 for _, it in decode], device=dev)
            mask = torch.arange(T, device=dev) < ends.unsqueeze(1)  # (B, T): each lane's length
            self.decode = (
                torch.tensor([o for o, _ in decode], device=dev),
                torch.tensor([it.lane for _, it in decode], device=dev),
                mask[:, None, None, :],  # (B, 1, 1, T)
                T,
            )


def load_stage(
    folder: str | Path, stage: int, *, world: int, device: str | torch.device = "cpu"
) -> StageModel:
    """This rank's stage from a model folder's shards (sha256 checked against the manifest)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.stages != world:
        raise DistlmError(
            f"{folder}/shards/manifest.json has {manifest.stages} stage shards but the pipeline "
            f"runs {world} ranks: launch one rank per shard (inference.stages for batch "
            "inference, serve.stages for serve)"
        )
    entry, tensors = load_stage_shard(folder, stage)  # sha256 checked first: fail before building
    config = load_config_json(folder)
    model = StageModel(config, entry)
    model.load_shard(tensors, f"{folder}/shards/{entry.file}")
    model.to(device)
    log.info(
        "stage %d on %s: layers %d-%d%s%s, %.1f MB",
        stage,
        device,
        model.start,
        model.end - 1,
        ", embeddings" if model.first else "",
        ", head" if model.last else "",
        sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
    )
    return model
