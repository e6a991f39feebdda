"""Training's loss modules: the LM head fused with its loss (the CPU's), the same in standard
operations (a GPU's), and transformers' own (the reference).

Which applies is the device's kernel set (distlm.device) and the family's logits (distlm.family):
the chunked linear cross-entropy on the CPU for a family whose logits are the plain LM head of its
hidden states (`Family.linear_logits`); `NextTokenLoss` elsewhere, standard operations that
torch.compile fuses (the chunked head, eager inside a compiled graph, made the compiled H100
step 1.7x slower). A family's own training kernels (GPT-2's one-kernel tanh GELU) are its
`prepare_training`. On every device and family, the fast kernels attend over whole blocks
(`attend_whole_blocks`): SDPA's `is_causal` without a mask, which transformers builds under
torch.compile and which keeps CUDA off its flash kernel.

Same function as transformers' `model(input_ids, labels=input_ids).loss` (the mean
cross-entropy of every next token), computed with less memory traffic. Measured on the embedded
default (2 ranks x 1 thread, 8 x 128 tokens per rank), the two together take about a fifth off the
step (see benchmarks/train and docs/performance.md, "Training"):

- `linear_cross_entropy`: the LM head's logits (tokens x vocab; 16 MB a rank for the embedded
  default, 3.3 GB for GPT-2 at 16 x 1024) are never materialised whole. Chunks of rows go through
  logits -> softmax -> gradient while they sit in cache, and the gradients of the hidden states
  and of the head's weight are made in the forward pass (backward only scales them). transformers
  writes the logits, their log-softmax and a zero-filled gradient of the same size, and reads
  each back.

Results agree with transformers' path to float rounding (tests/test_train.py), not bit for bit;
`train.fast_kernels: false` trains through transformers' own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

import torch

from distlm import DistlmError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

P = ParamSpec("P")
R = TypeVar("R")


def _chunk_rows(vocab: int, width: int) -> int:
    # Chunks of about 2 MiB of logits (the kernel set "cpu" is where this kernel runs), in cache from the matmul through the gradient: 128 rows
    # of a 4,096 vocabulary were fastest on a 2-core Xeon (64 rows 1.18x slower, 256 1.10x). But
    # every chunk reads and writes the head's whole weight gradient (V x C) once: where that is
    # beyond the caches, fewer chunks win. GPT-2's 50,257 x 768 head (154 MB), one thread:
    # 64 rows 2.20 s, 256 rows 1.66 s, one chunk of 1,023 rows 1.59 s (16 rows, the 2 MiB rule,
    # about 4.9 s).
    rows = (2 << 20) // (4 * vocab)
    if 4 * vocab * width > (8 << 20):
        rows = max(rows, 256)
    return max(16, rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(h_i @ W^T, t_i); gradients made in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int):
        # h (N, C) hidden states, weight (V, C) the head, targets (N,) token ids
        n = h.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = (
            torch.get_autocast_dtype(h.device.type)
            if torch.is_autocast_enabled(h.device.type)
            else h.dtype
        )
        w = weight.to(dtype)
        grad_h = torch.empty_like(h) if want_h else None
        # the first chunk's product writes grad_w (no zero fill); with no rows there is none
        grad_w = (torch.empty_like(weight) if n else torch.zeros_like(weight)) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, rows):
            hc, tc = h[s : s + rows].to(dtype), targets[s : s + rows]
            # one row-local kernel (max, sum of exp, subtract) while the row sits in cache
            logp = torch.log_softmax(torch.mm(hc, w.t()).float(), dim=1)  # (r, V)
            total -= logp.gather(1, tc[:, None]).sum()
            if not (want_h or want_w):
                continue
            g = logp.exp_()  # softmax, in place
            g[torch.arange(g.shape[0], device=g.device), tc] -= 1.0
            g = g.to(dtype)  # d(sum of the chunk's losses) / d(logits); 1/n is in backward
            if grad_h is not None:
                grad_h[s : s + rows] = torch.mm(g, w)
            if grad_w is not None:
                if grad_w.dtype == dtype and s == 0:
                    torch.mm(g.t(), hc, out=grad_w)
                elif grad_w.dtype == dtype:
                    grad_w.addmm_(g.t(), hc)
                elif s == 0:
                    grad_w.copy_(torch.mm(g.t(), hc))
                else:
                    grad_w += torch.mm(g.t(), hc).to(grad_w.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n  # the mean's 1/n, on the (N, C) and (V, C) sums, not the logits
        # Scaled in place: the sums are this node's own. A second backward through the same graph
        # (retain_graph) is refused by autograd (a saved tensor modified), never scaled twice.
        return (
            None if grad_h is None else grad_h.mul_(scale.to(grad_h.dtype)),
            None if grad_w is None else grad_w.mul_(scale.to(grad_w.dtype)),
            None,
            None,
        )


def _eager(fn: Callable[P, R]) -> Callable[P, R]:
    """torch.compiler.disable with its type (torch leaves it unannotated)."""
    return cast("Callable[P, R]", torch.compiler.disable(fn))


@_eager  # under train.compile the body is compiled and this runs eagerly
def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, rows: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` against `targets`; h (..., C), targets (...)."""
    h2 = h.reshape(-1, h.shape[-1])
    rows = rows or _chunk_rows(weight.shape[0], weight.shape[1])
    return _LinearCrossEntropy.apply(h2, weight, targets.reshape(-1), rows)


# -- attention over whole blocks -----------------------------------------------------------------
# transformers' SDPA path builds no mask in eager mode (SDPA's `is_causal`), but under
# torch.compile (torch < 2.14) it materialises a (batch, 1, T, T) boolean mask: it cannot read the
# position ids while tracing to rule out packed sequences, and dynamo turned its export check into
# a constant (its masking_utils). With a mask, SDPA on CUDA cannot take its flash kernel, and the
# Llama family's grouped heads are repeated instead of attended with `enable_gqa`. A training
# step's inputs are whole causal blocks: no padding, no cache, positions 0..T-1 that the model
# makes itself (the loss modules pass token ids alone). There the mask is exactly SDPA's
# `is_causal`, so this attention implementation builds none, compiled too, and refuses the calls
# whose mask would be more (a padding mask, a sliding window, queries after a cache).
WHOLE_BLOCKS = "distlm_whole_blocks"


def _whole_block_mask(**kw) -> None:
    """transformers' mask hook for WHOLE_BLOCKS: no mask, or an error naming what the call asked
    for beyond a causal block."""
    asked = {
        "a padding mask": kw.get("attention_mask") is not None,
        "a sliding window": kw.get("local_size") is not None,
        "queries after a KV cache": kw.get("q_length") != kw.get("kv_length")
        or kw.get("q_offset", 0) != 0,
    }
    beyond = [what for what, yes in asked.items() if yes]
    if beyond:
        raise DistlmError(
            f"{WHOLE_BLOCKS} attention (train.fast_kernels) takes whole causal blocks; this call "
            f"has {', '.join(beyond)} (train.fast_kernels: false trains through transformers' "
            "own attention)"
        )


def attend_whole_blocks(model: PreTrainedModel) -> None:
    """Have `model` (a transformers model on the SDPA path) attend as WHOLE_BLOCKS: transformers'
    own SDPA call with `is_causal` and no mask, eager and compiled alike. The weights and the
    config saved are unchanged (the attention implementation is not part of config.json)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(WHOLE_BLOCKS, sdpa_attention_forward)
    AttentionMaskInterface.register(WHOLE_BLOCKS, _whole_block_mask)
    model.set_attn_implementation(WHOLE_BLOCKS)


class CausalLMLoss(torch.nn.Module):
    """A causal LM's next-token loss through `linear_cross_entropy` (wrap this in DDP): its
    family's decoder (distlm.family: `Family.decoder`) then its bias-free `lm_head`, for a
    family whose logits are that head's product (`Family.linear_logits`).

    Holds the model as its only child, so DDP sees the same parameters in the same order.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        from distlm.family import family_of

        self.model = model
        self.family = family_of(model.config)
        assert self.family.linear_logits, self.family.model_type

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.family.decoder(self.model)
        h = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        # position t predicts token t + 1: the last position has nothing to predict
        return linear_cross_entropy(h[:, :-1], self.model.lm_head.weight, input_ids[:, 1:])


class NextTokenLoss(torch.nn.Module):
    """The next-token loss in standard operations (the "standard" kernel set, for GPUs): the
    family's decoder and logits hook (distlm.family) on every position but the last, the
    cross-entropy in float32 (as nanoGPT and torchtitan take it). Under torch.compile the head's
    product, the upcast and the loss are one graph, which inductor fuses; eager, it is
    transformers' arithmetic without the shifted copies of its loss."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        from distlm.family import family_of

        self.model = model
        self.family = family_of(model.config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.family.decoder(self.model)
        h = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        # (B, T - 1, V): position t predicts t + 1
        logits = self.family.logits(self.model.lm_head, h[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), input_ids[:, 1:].flatten()
        )


class ReferenceLoss(torch.nn.Module):
    """transformers' own loss path (`train.fast_kernels: false`), with CausalLMLoss's signature."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
