"""Training's loss modules over distlm's model (distlm.family.transformer): the next-token loss in
standard operations (`NextTokenLoss`: what a GPU runs, compiled), and the LM head fused with its
loss (`CausalLMLoss`: the CPU's, where it pays).

Which applies is the device's kernel set (distlm.runtime.device) and the model's logits: the chunked
linear cross-entropy on the CPU for a model whose logits are the plain LM head of its hidden
states (`Transformer.linear_logits`); `NextTokenLoss` elsewhere, standard operations that
torch.compile fuses (the chunked head, eager inside a compiled graph, made the compiled H100
step slower: benchmarks/LOG.md, "GPU"). `train.fast_kernels: false` takes `NextTokenLoss` on every device.

Both are transformers' `model(input_ids, labels=input_ids).loss` (the mean cross-entropy of
every next token; tests/test_family_model.py checks them against it), and both attend with
SDPA's `is_causal` over whole blocks (the model's own attention: flash or cuDNN on CUDA).

- `linear_cross_entropy`: the LM head's logits (tokens x vocab; 16 MB a rank for the embedded
  default, 3.3 GB for GPT-2 at 16 x 1024) are never materialised whole. Chunks of rows go through
  logits -> softmax -> gradient while they sit in cache, and the gradients of the hidden states
  and of the head's weight are made in the forward pass (backward only scales them). What it
  saves on the embedded default's step: benchmarks/LOG.md, "Training".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

from distlm.family.transformer import Transformer

P = ParamSpec("P")
R = TypeVar("R")


def _chunk_rows(vocab: int, width: int) -> int:
    # Chunks of about 2 MiB of logits (the kernel set "cpu" is where this kernel runs), in cache
    # from the matmul through the gradient. But every chunk reads and writes the head's whole
    # weight gradient (V x C) once: where that is beyond the caches, fewer chunks win, so a head
    # over 8 MiB takes chunks of at least 256 rows (the measurements: benchmarks/LOG.md,
    # "Training: the fused head's chunks").
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


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, rows: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` against `targets`; h (..., C), targets (...)."""
    h2 = h.reshape(-1, h.shape[-1])
    rows = rows or _chunk_rows(weight.shape[0], weight.shape[1])
    return _LinearCrossEntropy.apply(h2, weight, targets.reshape(-1), rows)


class NextTokenLoss(torch.nn.Module):
    """The next-token loss in standard operations (the "standard" kernel set: a GPU's): the
    model's final hidden states and logits on every position but the last, the cross-entropy in
    float32 (as nanoGPT and torchtitan take it). Under torch.compile the whole step is one graph:
    inductor fuses the head's upcast and the loss.

    Holds the model as its only child, so DDP sees the same parameters in the same order."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids)[:, :-1]  # (B, T - 1, V): position t predicts t + 1
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), input_ids[:, 1:].flatten()
        )


class CausalLMLoss(NextTokenLoss):
    """The next-token loss through `linear_cross_entropy` (the CPU's kernel set): the model's
    final hidden states, then its bias-free LM head fused with the loss, for a model whose logits
    are that head's product (`Transformer.linear_logits`). `compiled`: the module runs under
    torch.compile, which then runs the fused head eagerly (torch.compiler.disable: only then, as
    it imports torch's compiler, 1.5 CPU-s a process)."""

    def __init__(self, model: Transformer, *, compiled: bool = False) -> None:
        super().__init__(model)
        assert model.linear_logits, type(model).__name__
        self.head_loss = _eager(linear_cross_entropy) if compiled else linear_cross_entropy

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # position t predicts token t + 1: the last position has nothing to predict. The head's
        # weight is the model's to give, inside its forward pass (a sharded root's is gathered
        # there: distlm.family.transformer's `head_loss`).
        targets = input_ids[:, 1:]
        return self.model(
            input_ids, head_loss=lambda h, weight: self.head_loss(h[:, :-1], weight, targets)
        )
