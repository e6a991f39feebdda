"""distlm's model of a family: a decoder of per-block modules, owned by distlm as torchtitan and
litgpt own theirs. Training (DDP, torch.compile), evaluation and the pipeline engine all run it;
a pipeline stage runs a range of its blocks.

    model = family.build(args, device="cuda")          # the whole decoder (weights to load)
    model.load_hf(tensors, where)                      # transformers' names and layouts
    logits = model(ids)                                # (B, T) -> (B, T, V)
    h = model(ids, head=False)                         # the final norm's output (B, T, C)
    stage = family.build(args, Cut(4, 8, first=False, last=True))   # a pipeline stage

A block's math comes in two halves around attention (`Block.project`, `Block.finish`), so that
training's attention (SDPA's `is_causal` over whole blocks: flash or cuDNN on CUDA) and the
pipeline engine's (over its KV cache) run the same block code:

    x = model.embed(ids, pos)                # (..., C); positions enter here (GPT-2) or below
    rot = model.positions(pos, x.dtype)      # per forward: rotary cos/sin, or None
    for block in model.blocks:
        q, kv = block.qkv(x, rot)            # (..., n_heads, D), (..., 2, n_kv_heads, D)
        x = block.finish(x, attention(q, kv))   # the caller's attention: (..., n_heads * D)
    logits = model.head(x)                   # final norm, then the LM head

Every tensor has transformers' name and layout at the boundary (`TensorMap`): a model folder,
a checkpoint and a pipeline shard hold transformers' tensors, so `AutoModelForCausalLM`,
`transformers serve` and vLLM load what distlm writes; inside, projections are fused where the
family allows (GPT-2's q|k|v as transformers has it, the Llama family's q|k|v and gate|up) and
every projection is an `nn.Linear`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
from distlm.family.packing import Packing
from distlm.family.spec import ACTIVATIONS, ModelArgs
from distlm.family.table import Cut, Rule

# ----------------------------------------------------------------------------- blocks


class Block(nn.Module):
    """One decoder block (a family's subclass holds its weights): `project` before attention,
    `finish` after it; `forward` attends over whole causal blocks (training, evaluation)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float  # SDPA's scale
    attn_dropout: float  # of the attention probabilities, in training

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.gqa = args.gqa
        self.scale = args.head_dim**-0.5
        self.attn_dropout = args.attn_dropout
        # activation checkpointing (train.activation_checkpointing): keep the block's input
        # alone and compute its activations again in the backward pass
        self.checkpointing = False

    def project(self, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, ...]:
        """Queries (..., n_heads, D), keys and values (..., n_kv_heads, D) of hidden states
        (..., C); `rot` is the model's `positions` (rotary families rotate q and k here)."""
        raise NotImplementedError

    def qkv(self, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`project` as the pipeline engine's cache takes it: queries (..., n_heads, D) and keys
        and values together (..., 2, n_kv_heads, D), one write into the cache."""
        q, k, v = self.project(x, rot)
        return q, torch.stack((k, v), dim=-3)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The block after attention: `x` its input (..., C), `attn` the attention's output
        (..., n_heads * D) -> its output (..., C)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, rot: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block over whole causal blocks x (B, T, C): SDPA with `is_causal` and no mask,
        which takes the flash (or cuDNN) kernel on CUDA; grouped heads are attended as they are
        (`enable_gqa`), not repeated. `mask` (B, 1, T, T), a packed batch's (Packing.mask):
        attention within each example alone. With `checkpointing`, in training, its activations
        are computed again in the backward pass (torch.utils.checkpoint) instead of kept."""
        if self.checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._attend_whole, x, rot, mask, use_reentrant=False)
        return self._attend_whole(x, rot, mask)

    def _attend_whole(self, x: torch.Tensor, rot: Any, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.project(x, rot)  # (B, T, nh, D), (B, T, nkv, D) x 2
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (B, nh, T, D)
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.gqa,
        )
        return self.finish(x, o.transpose(1, 2).flatten(2))  # (B, T, nh * D) -> (B, T, C)


def activation(name: str):
    """The MLP's activation of transformers' ACT2FN name (config.json's), in one standard op, as
    distlm.family.spec's ACTIVATIONS declares it."""
    function, keywords = ACTIVATIONS[name]
    return functools.partial(getattr(F, function), **keywords)


# distlm's models are loaded, never initialised: their weights are allocated where they run and
# left unset (no random init to overwrite: GPT-2 small's costs a CPU second; nn.Embedding's,
# even on the meta device, imports torch's compiler, 1.5 CPU-s a process)


class Linear(nn.Linear):
    """nn.Linear, its weight and bias allocated but not set."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Module):
    """A lookup table (nn.Embedding's weight and math), its weight allocated but not set."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm as the Llama family computes it: normalised in float32, scaled in the input's
    dtype (transformers' LlamaRMSNorm; torch.compile fuses it into one kernel)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# ----------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    """A family's decoder, or what a `Cut` of it holds (a pipeline stage: blocks [start, end),
    embeddings when `first`, the final norm and the LM head when `last`). Blocks are held by
    their index in the whole model (`layers["7"]`), so a tensor's name is the same however the
    model is cut (torchtitan's pipeline stages name them so). Its parameters are its family's
    table's (`distlm.family.table`): their names, shapes and transformers' names."""

    linear_logits = True  # logits = hidden @ lm_head.weight.T (training's fused head applies)

    def __init__(self, args: ModelArgs, cut: Cut | None = None) -> None:
        super().__init__()
        self.args = args
        self.cut = (cut or Cut.whole(args.n_layers)).check(args.n_layers)
        self.table = args.TABLE
        if self.cut.first:
            self.embedding = self.make_embedding()
        self.layers = nn.ModuleDict({str(i): self.make_block(i) for i in self.cut.layers})
        if self.cut.last:
            self.norm = self.make_norm()
            self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.args.tied and self.cut.both_ends:  # the head is the input embedding
            self.lm_head.weight = self.get_parameter(self.table.embedding_param)

    def _apply(self, fn, recurse=True):
        # moving a module makes its parameters anew, one module at a time (from the meta device
        # always): the head is tied again to what the embedding now holds
        out = super()._apply(fn, recurse)
        self._tie()
        return out

    # -- what a family's model says ------------------------------------------------------------
    def make_embedding(self) -> nn.Module:
        raise NotImplementedError

    def make_block(self, layer: int) -> Block:
        raise NotImplementedError

    def make_norm(self) -> nn.Module:
        raise NotImplementedError

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token ids (...) at positions `pos` (...) -> hidden states (..., C) (first)."""
        return self.embedding(ids, pos)

    @property
    def blocks(self) -> list[Block]:
        """The blocks, in order (what `layers` holds: a wrapper put there, activation
        checkpointing's, is what runs)."""
        return list(self.layers.values())  # pyright: ignore[reportReturnType]

    def positions(self, pos: torch.Tensor, dtype: torch.dtype) -> Any:
        """What the blocks need of the positions (...), computed once per forward and shared by
        every block: None for a family whose positions enter with the embedding."""
        return None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final (normed) hidden states (..., C) -> (..., V): the LM head. A family
        whose logits are more (a soft cap, a scale) says so here and sets linear_logits False."""
        return self.lm_head(h)

    # -- running it ----------------------------------------------------------------------------
    def checkpoint_blocks(self, on: bool) -> None:
        """Activation checkpointing per block (train.activation_checkpointing): each block keeps
        its input alone and computes its activations again in the backward pass."""
        for block in self.blocks:
            block.checkpointing = on

    def forward(
        self,
        ids: torch.Tensor,
        *,
        packing: Packing | None = None,
        head: bool = True,
        head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) at positions 0..T-1 -> logits (B, T, V), or with `head` False the
        final norm's output (B, T, C) (a whole model: first and last), or with `head_loss` what
        it makes of that output and the LM head's weight (a loss that fuses the head: training's
        on the CPU). With `packing`, each row holds examples packed end to end: each example's
        positions start at 0 and it attends to itself alone. Training and evaluation call the
        model (not its parts), and the head's weight is read here, inside its forward pass, so
        that FSDP's hooks have gathered what it holds sharded whatever they reshard when."""
        if packing is None:
            pos, mask = torch.arange(ids.shape[1], device=ids.device), None
        else:
            pos, mask = packing.positions(), packing.mask()
        x = self.embed(ids, pos)  # (B, T, C)
        rot = self.positions(pos, x.dtype)
        for block in self.layers.values():
            x = block(x, rot, mask)
        h = self.norm(x)
        if head_loss is not None:
            return head_loss(h, self.lm_head.weight)
        return self.logits(h) if head else h

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's end: the final norm, then the logits (..., C) -> (..., V)."""
        return self.logits(self.norm(x))

    # -- transformers' names -------------------------------------------------------------------
    def tensor_map(self) -> TensorMap:
        """The map between this model's parameters and transformers' tensors."""
        rules = self.table.rules(self.args)
        return TensorMap(rules, [n for n, _ in self.named_parameters()])

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under transformers' names and layouts (views where they can be; a
        tied head omitted, as transformers saves it)."""
        return self.tensor_map().to_hf(dict(self.named_parameters()))

    @torch.no_grad()
    def load_hf(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Load transformers-named tensors (a model folder's, a checkpoint's, a pipeline shard's):
        names and shapes must be exactly this model's (the error names the tensor and `where`),
        values are cast to each parameter's dtype. A tied head's own copy (what a pipeline shard
        holding both ends carries) must equal the embedding it is, and is not loaded twice."""
        mine = self.hf_tensors()
        head, embedding = self.table.head, self.table.embedding
        if head in tensors and head not in mine and self.args.tied and self.cut.both_ends:
            if embedding in tensors and not torch.equal(tensors[head], tensors[embedding]):
                raise DistlmError(f"{where}: tied tensor {head!r} differs from {embedding!r}")
            tensors = {k: v for k, v in tensors.items() if k != head}
        check_tensors(tensors, {k: v.shape for k, v in mine.items()}, where)
        for name, value in self.tensor_map().from_hf(tensors).items():
            p = self.get_parameter(name)
            p.copy_(value.to(p.dtype))

    @torch.no_grad()
    def staged_hf(self, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        """transformers-named tensors made ready to become this model's parameters, beside them
        (a live update's staging: `load_staged` then copies them in): names and shapes checked
        as `load_hf` checks them, each in its parameter's layout, dtype and device."""
        mine = self.hf_tensors()
        check_tensors(tensors, {k: v.shape for k, v in mine.items()}, where)
        out = {}
        for name, value in self.tensor_map().from_hf(tensors).items():
            p = self.get_parameter(name)
            out[name] = value.to(device=p.device, dtype=p.dtype, copy=True)
        return out

    @torch.no_grad()
    def load_staged(self, staged: Mapping[str, torch.Tensor]) -> None:
        """Copy `staged_hf`'s tensors into the parameters, in place: what holds the parameters
        (a CUDA graph) sees the new values."""
        for name, value in staged.items():
            self.get_parameter(name).copy_(value)


def check_tensors(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Iterable[int]], where: str
) -> None:
    """Names and shapes of `tensors` must be `expected`'s; the error names the tensor."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise DistlmError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    if extra:
        raise DistlmError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected)")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise DistlmError(
                f"{where}: tensor {k!r} has shape {tuple(tensors[k].shape)}, config expects "
                f"{tuple(shape)}"
            )


# ----------------------------------------------------------------------------- names


_INDEX = re.compile(r"\.(\d+)\.")


class TensorMap:
    """distlm's tensors <-> transformers' (a family's `Rule`s, for the parameters a model has)."""

    def __init__(self, rules: Iterable[Rule], names: Iterable[str]) -> None:
        by_template = {r.ours: r for r in rules}
        self.rules: dict[str, tuple[Rule, str | None]] = {}  # our name -> (rule, block index)
        for name in names:
            m = _INDEX.search(name)
            template = name if m is None else f"{name[: m.start()]}.{{i}}.{name[m.end() :]}"
            rule = by_template.get(template)
            if rule is None:
                raise DistlmError(f"no transformers name for parameter {name!r}")
            self.rules[name] = (rule, None if m is None else m.group(1))

    def hf_names(self, name: str) -> list[str]:
        """The transformers tensors that distlm's `name` is, in its order."""
        rule, i = self.rules[name]
        return [h.format(i=i) for h in rule.hf]

    def split(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """distlm's tensor `name` (a parameter, or its per-parameter state: AdamW's moments) as
        the transformers tensors it is: views of it."""
        rule, _ = self.rules[name]
        hf = self.hf_names(name)
        if rule.kind == "same":
            return {hf[0]: t}
        if rule.kind == "t":
            return {hf[0]: t.t()}
        return dict(zip(hf, t.split(rule.sizes, dim=0), strict=True))

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The transformers tensors `hf_names(name)` (in that order) as distlm's tensor `name`
        (fused ones joined: a new tensor)."""
        rule, _ = self.rules[name]
        if rule.kind == "same":
            return parts[0]
        if rule.kind == "t":
            return parts[0].t()
        return torch.cat(parts, dim=0)

    def rows(
        self, name: str, start: int, stop: int, read: Callable[[str, slice, int], torch.Tensor]
    ) -> torch.Tensor:
        """Rows [start, stop) of distlm's tensor `name` (a shard along its first dimension, as
        FSDP holds it), from transformers' tensors read in part: `read(hf_name, span, dim)`
        gives the span of an hf tensor's rows (dim 0) or columns (dim 1). No whole tensor is
        read: a transposed one gives columns, a fused one the rows of each part it spans."""
        rule, _ = self.rules[name]
        hf = self.hf_names(name)
        if rule.kind == "same":
            return read(hf[0], slice(start, stop), 0)
        if rule.kind == "t":
            return read(hf[0], slice(start, stop), 1).t()
        parts, offset = [], 0
        for h, size in zip(hf, rule.sizes, strict=True):
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                parts.append(read(h, slice(lo - offset, hi - offset), 0))
            offset += size
        return torch.cat(parts, dim=0)

    def to_hf(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """distlm-named tensors -> transformers-named ones, as views of them."""
        return {h: v for name, t in tensors.items() for h, v in self.split(name, t).items()}

    def from_hf(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers-named tensors (every one of this map's) -> distlm's."""
        return {
            name: self.join(name, [tensors[h] for h in self.hf_names(name)]) for name in self.rules
        }
