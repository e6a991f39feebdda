"""One pipeline stage: its transformer blocks (transformers' GPT2Block), a KV cache per lane.

A stage runs a *micro-batch*: several sequences (each in its own lane) packed along the token axis,
(1, N, C) with N = sum of the items' new tokens. The per-token work (layer norms, QKV and output
projections, MLP) runs on the packed tensor; attention runs per item against that lane's cache,
with the same SDPA call Hugging Face's GPT-2 makes, so a sequence's logits do not depend on which
other sequences share its micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
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

    def __init__(self, config, entry: dict) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config._attn_implementation = "sdpa"
        self.config = config
        self.stage = entry["stage"]
        self.start, self.end = entry["layers"]
        self.first = bool(entry["has_embeddings"])
        self.last = bool(entry["has_head"])
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
        # lane -> per local layer [key, value], each (1, n_head, T, head_dim)
        self.cache: dict[int, list[list[torch.Tensor]]] = {}

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
        self.cache.pop(lane, None)

    def fork(self, parent: int, child: int) -> None:
        """`child` continues from `parent`'s cache (n > 1: one prefill for every choice).

        The tensors are shared, not copied: a decode step concatenates into new tensors
        (torch.cat), so neither lane ever writes into the other's.
        """
        self.cache[child] = [list(kv) for kv in self.cache[parent]]

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
            x = self.wte(x.to(dev).unsqueeze(0)) + self.wpe(positions.unsqueeze(0))  # (1, N, C)
        else:
            x = x.to(dev, self.dtype).unsqueeze(0)  # (1, N, C)
        for it in items:
            if it.pos == 0:
                self.cache[it.lane] = [[None, None] for _ in self.h]
            elif it.lane not in self.cache:
                raise DistlmError(
                    f"stage {self.stage}: lane {it.lane} has no KV cache at position {it.pos}"
                )
        for j, block in enumerate(self.h):
            x = self._block(j, block, items, x)
        x = x.squeeze(0)  # (N, C)
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

    def _block(self, j: int, block, items: list[Item], x: torch.Tensor) -> torch.Tensor:
        attn = block.attn
        C = x.shape[-1]
        residual = x
        qkv = attn.c_attn(block.ln_1(x))  # (1, N, 3C)
        q, k, v = qkv.split(C, dim=2)
        outs, off = [], 0
        for it in items:
            shape = (1, it.n, self.n_head, self.head_dim)
            qi = q[:, off : off + it.n].reshape(shape).transpose(1, 2)  # (1, nh, n, hd)
            ki = k[:, off : off + it.n].reshape(shape).transpose(1, 2)
            vi = v[:, off : off + it.n].reshape(shape).transpose(1, 2)
            kv = self.cache[it.lane][j]
            if kv[0] is not None:
                ki = torch.cat([kv[0], ki], dim=2)  # (1, nh, T, hd)
                vi = torch.cat([kv[1], vi], dim=2)
            kv[0], kv[1] = ki, vi
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=None, dropout_p=0.0, scale=self.scales[j], is_causal=it.n > 1
            )
            outs.append(o.transpose(1, 2).reshape(1, it.n, C))
            off += it.n
        a = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        x = residual + attn.c_proj(a)
        return x + block.mlp(block.ln_2(x))


def load_stage(
    folder: str | Path, stage: int, *, world: int, device: str | torch.device = "cpu"
) -> StageModel:
    """This rank's stage from a model folder's shards (sha256 checked against the manifest)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest["stages"] != world:
        raise DistlmError(
            f"{folder}/shards/manifest.json has {manifest['stages']} stage shards but the pipeline "
            f"runs {world} ranks: launch one rank per shard (inference.stages)"
        )
    entry, tensors = load_stage_shard(folder, stage)  # sha256 checked first: fail before building
    config = load_config_json(folder)
    model = StageModel(config, entry)
    model.load_shard(tensors, f"{folder}/shards/{entry['file']}")
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
