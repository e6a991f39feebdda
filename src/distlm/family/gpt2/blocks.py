"""GPT-2's per-token math for a pipeline stage (`GPT2LMHeadModel`): learned positions, layer norms,
Conv1D projections (linear layers with the weight transposed), GELU MLP, a head tied to wte.

The weights are transformers' own `GPT2Block`s, used through the functional operations their
forward calls (the same kernels, without a module call each). Where the result is a fresh tensor
used once, the next operation writes into it (the residual adds, `gelu_new`'s chain): the same
arithmetic in the same order, so the same bits, without an allocation per operation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distlm.family.blocks import StageBlocks


class GPT2Blocks(StageBlocks):
    """wte + wpe (first), `GPT2Block`s [start, end), ln_f + lm_head (last)."""

    def __init__(
        self, config, start: int, end: int, *, first: bool, last: bool, kernels: str = "standard"
    ) -> None:
        from transformers.activations import ACT2FN
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        super().__init__(start=start, end=end, first=first, last=last)
        config._attn_implementation = "sdpa"
        C = config.n_embd
        if first:
            self.wte = nn.Embedding(config.vocab_size, C)
            self.wpe = nn.Embedding(config.n_positions, C)
        self.h = nn.ModuleList(GPT2Block(config, layer_idx=i) for i in range(start, end))
        self._h: list[Any] = list(self.h)  # the same modules, indexed without a call
        # the MLP's activation (GPT2MLP's ACT2FN[activation_function]). GPT-2's gelu_new: on the
        # CPU (kernel set "cpu", distlm.device) in place in four operations, which pays where every
        # operation costs microseconds; elsewhere torch's tanh GELU, one standard kernel.
        act = config.activation_function
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACT2FN[act].forward
        if act == "gelu_new":
            self.act = gelu_new_ if kernels == "cpu" else gelu_tanh
        if last:
            self.ln_f = nn.LayerNorm(C, eps=config.layer_norm_epsilon)
            self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.n_head = self.n_kv_head = config.n_head
        self.head_dim = C // config.n_head
        self.context = config.n_positions
        self.scales = []
        for i in range(start, end):
            s = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                s /= float(i + 1)
            self.scales.append(s)

    def local_name(self, name: str) -> str:
        if name.startswith("transformer.h."):
            layer, rest = name[len("transformer.h.") :].split(".", 1)
            return f"h.{int(layer) - self.start}.{rest}"
        if name.startswith("transformer."):
            return name[len("transformer.") :]
        return name

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(pos)  # (N, C)

    def qkv(self, j: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        block = self._h[j]
        qkv = _conv1d(block.attn.c_attn, _layer_norm(block.ln_1, x))  # (N, 3C): q | k | v
        t = qkv.view(-1, 3, self.n_head, self.head_dim)
        return t[:, 0], t[:, 1:]  # (N, nh, hd), (N, 2, nh, hd): views of qkv

    def finish(self, j: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self._h[j]
        mlp = block.mlp
        # x + proj(attn) and x + mlp(x), written into the fresh projections (addition commutes)
        x = _conv1d(block.attn.c_proj, attn).add_(x)
        return _conv1d(mlp.c_proj, self.act(_conv1d(mlp.c_fc, _layer_norm(block.ln_2, x)))).add_(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.lm_head, self.ln_f(x))


_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_2K: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # 2 sqrt(2 / pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_new` as torch's tanh GELU: one kernel (the "standard" kernel set)."""
    return F.gelu(x, approximate="tanh")


def gelu_new_(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_new` (NewGELUActivation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
    x^3)))), written into x and one new tensor, in four operations instead of eight: 0.5 (1 +
    tanh(z)) is sigmoid(2 z), so it is x sigmoid(2 sqrt(2 / pi) x (1 + 0.044715 x^2)). The same
    function to float rounding (tests/test_family.py: in float32 within twice transformers' own
    float32 error of float64, and within 1e-6 of transformers' float32), not to the bit. The
    serving engine's steps, where every operation costs microseconds, gained 2.5% at 16 clients
    and 7% at 64 (benchmarks/inference/probe_serve_steps.py; docs/performance.md, "Serving").

    The constant is a 0-dim tensor on the input's device, of the dtype the kernels compute in
    (float32, or float64 for float64), made once per device: an operation with a Python number
    first converts it into such a tensor (two dispatches more, each time). It is made on the
    input's device: a CPU constant crashed addcmul on CUDA tensors (the H100 run of 2026-11-25).
    The engine uses this form on the CPU only (distlm.device's kernel set "cpu")."""
    k2 = _gelu_constant(x.dtype, x.device)  # 2 sqrt(2 / pi)
    s = torch.addcmul(k2, x, x, value=2 * _GELU_K * 0.044715)  # 2 sqrt(2 / pi) (1 + 0.044715 x^2)
    s.mul_(x).sigmoid_()
    return x.mul_(s)


def _gelu_constant(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    k = _GELU_2K.get((dtype, device))
    if k is None:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        k = _GELU_2K[dtype, device] = torch.tensor(2 * _GELU_K, dtype=compute, device=device)
    return k


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _conv1d(c, x: torch.Tensor) -> torch.Tensor:
    """transformers' Conv1D (a linear layer with its weight transposed) on (N, in)."""
    return torch.addmm(c.bias, x, c.weight)
