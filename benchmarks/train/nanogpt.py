"""The reference a GPU user would write: nanoGPT's GPT-2 (karpathy/nanoGPT's `model.py`, in its
spirit: one module, SDPA's causal attention, the tanh GELU, a head tied to the embedding, the
loss computed inside the forward), which `bench_train.py --only nanogpt` trains as nanoGPT's
`train.py` does: `torch.compile` of the whole model and loss, fused AdamW with weight decay on the
matrices only, gradient clipping at 1.0, bf16 autocast.

    model = GPT.from_gpt2_folder("results/model/base")   # the weights of a distlm GPT-2 folder
    loss = model(x)                                       # mean next-token loss of x (B, T)

It loads the same weights distlm trains (transformers' GPT-2 tensors; the Conv1D weights
transposed into linear layers, as nanoGPT's `from_pretrained` does), so the loop it runs computes
the same function on the same data (tests/test_reference_loop.py checks the loss against
`GPT2LMHeadModel`'s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int  # positions
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    eps: float = 1e-5  # LayerNorm's epsilon (GPT-2's layer_norm_epsilon)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.eps)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.eps)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of idx (B, T): position t predicts token t + 1."""
        x, targets = idx[:, :-1], idx[:, 1:]
        pos = torch.arange(x.shape[1], device=idx.device)
        h = self.wte(x) + self.wpe(pos)  # (B, T - 1, C)
        for block in self.h:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))  # (B, T - 1, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @classmethod
    def from_gpt2_folder(cls, folder: str | Path) -> GPT:
        """The weights of a GPT-2 model folder (config.json, model.safetensors; distlm's or
        transformers'), as nanoGPT's from_pretrained loads the hub's."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        model = cls(
            GPTConfig(
                block_size=cfg["n_positions"],
                vocab_size=cfg["vocab_size"],
                n_layer=cfg["n_layer"],
                n_head=cfg["n_head"],
                n_embd=cfg["n_embd"],
                eps=cfg.get("layer_norm_epsilon", 1e-5),
            )
        )
        sd = load_file(str(folder / "model.safetensors"))
        conv1d = (
            "attn.c_attn.weight",
            "attn.c_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_proj.weight",
        )
        ours = model.state_dict()
        for k, v in sd.items():
            if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
                continue  # the causal mask buffers; the tied head is wte
            v = v.t() if k.endswith(conv1d) else v
            k = k.removeprefix("transformer.")  # nanoGPT's names, one level up
            ours[k].copy_(v.to(ours[k].dtype))
        return model


def main() -> None:
    """Load a GPT-2 folder into the reference and print its parameters and a batch's loss."""
    import argparse

    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("folder", help="a GPT-2 model folder (config.json, model.safetensors)")
    p.add_argument("--batch", type=int, default=2, help="random blocks of the model's context")
    a = p.parse_args()
    model = GPT.from_gpt2_folder(a.folder).eval()
    c = model.config
    x = torch.randint(0, c.vocab_size, (a.batch, c.block_size), generator=torch.Generator())
    with torch.no_grad():
        loss = model(x).item()
    n = sum(t.numel() for t in model.parameters())
    print(json.dumps({"parameters": n, "loss_of_random_tokens": round(loss, 4)}))


if __name__ == "__main__":
    main()
