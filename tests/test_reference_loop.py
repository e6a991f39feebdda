"""The training benchmark's nanoGPT-style reference (benchmarks/train/nanogpt.py) computes what
distlm's training computes: on the same GPT-2 weights and tokens, its loss and gradients equal
the training stage's loss module's (distlm's GPT-2, standard kernels) to float rounding. A
baseline that trained another function would be a straw man."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from harness.synthetic import make_inputs

from distlm.data import TokenBlocks
from distlm.model import load_model_dir
from distlm.train.kernels import NextTokenLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "train"))
from nanogpt import GPT


def test_the_reference_loop_trains_the_same_function(tmp_path):
    inputs = make_inputs(tmp_path, n_layer=2, n_head=2, n_embd=32, vocab=128, block_size=16)
    ref = load_model_dir(inputs["model"]).train()
    ours = GPT.from_gpt2_folder(inputs["model"]).train()
    x = torch.from_numpy(TokenBlocks(inputs["tokens"], "train")[[0, 1, 2]])
    want = NextTokenLoss(ref)(x)
    want.backward()
    got = ours(x)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-5
    # both in transformers' names: nanoGPT's are transformers' one level up, its linear layers'
    # weights the transposes of transformers' Conv1D ones
    grads = ref.tensor_map().to_hf({n: p.grad for n, p in ref.named_parameters()})
    for name, p in ours.named_parameters():
        hf = "lm_head.weight" if name == "lm_head.weight" else f"transformer.{name}"
        g = grads[hf if hf in grads else "transformer.wte.weight"]
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            g = g.t()  # Conv1D's weight is the transpose of a linear layer's
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=name)
