"""distlm's own model of each family (distlm.family.transformer) against transformers' model of
the same weights, on the five shapes distlm supports: GPT-2; Llama with grouped KV heads,
untied; Qwen2 with biases on q, k and v; Qwen3 with its query/key norm and a head width that is
not width / heads; SmolLM2's shape (3:1 grouped heads, a gated MLP of 8/3, tied).

- logits and loss within float tolerance, and gradients after one step (and after one AdamW step
  on both, the next step's);
- the config mapping reads what transformers' config class reads, the tensor map round-trips,
  transformers' parameter order is known (a checkpoint before distlm's own model numbered its
  optimizer's state by it), and the rotary scalings' frequencies are transformers';
- what the model cannot run is refused naming the file and the key;
- the training step of each family compiles with fullgraph=True (no graph breaks).

The pipeline's greedy ids against `generate` are tests/test_inference.py's (GPT-2) and
tests/test_family_pipeline.py's (the Llama family); the evaluation's perplexity against the HF
guide's loop is tests/test_eval.py's and tests/test_family.py's."""

from __future__ import annotations

import pytest
import torch
from harness.families import LLAMA3_ROPE
from harness.family_shapes import SHAPES, VOCAB, ids, models

from distlm import DistlmError
from distlm.family import Cut, family_of, model_args
from distlm.train.legacy import transformers_order


def hf_grads(ours) -> dict[str, torch.Tensor]:
    """distlm's gradients under transformers' names."""
    return ours.tensor_map().to_hf({n: p.grad for n, p in ours.named_parameters()})


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_and_loss_equal_transformers(shape):
    from distlm.train.kernels import NextTokenLoss

    hf, ours = models(shape)
    hf.eval(), ours.eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-5, atol=1e-5)
        want = hf(input_ids=x, labels=x).loss
        assert NextTokenLoss(ours)(x).item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_after_one_step_equal_transformers(shape):
    """The loss's gradients on both; then one AdamW step on each (the same settings, on the same
    tensors under their own names) and the next step's loss and gradients: within float
    tolerance."""
    from distlm.train.kernels import NextTokenLoss

    hf, ours = models(shape)
    hf.train(), ours.train()
    loss = NextTokenLoss(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (hf, ours)]
    for step in range(2):
        x = ids(seed=10 + step)
        for opt in opts:
            opt.zero_grad()
        want = hf(input_ids=x, labels=x).loss
        want.backward()
        got = loss(x)
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-5), step
        grads = hf_grads(ours)
        for name, p in hf.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
        for opt in opts:
            opt.step()
    # (the weights after a step are not compared: AdamW's first steps scale each gradient to
    # about lr whatever its size, so a gradient that is rounding noise, a key bias's, moves its
    # weight by +-lr either way; what those weights do, nothing, the second step's gradients show)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_config_mapping_reads_what_transformers_reads(shape):
    """The args of config.json are what transformers' config class makes of it, the arch
    signature is the one distlm digested before it ran its own model (transformers' config
    attributes), and the parameter count is the model's."""
    hf, ours = models(shape)
    c = hf.config
    a = ours.args
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert (a.vocab_size, a.dim, a.n_layers) == (c.vocab_size, c.hidden_size, c.num_hidden_layers)
    assert (a.n_heads, a.head_dim, a.context) == (
        c.num_attention_heads,
        head_dim,
        c.max_position_embeddings,
    )
    assert a.n_kv_heads == getattr(c, "num_key_value_heads", c.num_attention_heads)
    assert a.tied == c.tie_word_embeddings
    keys = (
        ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
        if a.model_type == "gpt2"
        else (
            "model_type",
            "vocab_size",
            "max_position_embeddings",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
            *(("head_dim",) if a.model_type == "qwen3" else ()),
        )
    )
    assert a.signature() == {k: getattr(c, k) for k in keys}
    assert a.parameters() == sum(p.numel() for p in hf.parameters())
    # a config.json with only its model_type is read as the config class's defaults
    bare = model_args({"model_type": a.model_type}, "bare")
    cls = type(c)()
    assert (bare.dim, bare.n_layers, bare.vocab_size) == (
        cls.hidden_size,
        cls.num_hidden_layers,
        cls.vocab_size,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_the_tensor_map_round_trips_and_knows_transformers_order(shape):
    hf, ours = models(shape)
    theirs = dict(hf.named_parameters())
    mine = ours.hf_tensors()
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert transformers_order(ours) == list(theirs)  # their registration order
    back = ours.tensor_map().from_hf(mine)
    assert all(torch.equal(back[n], p) for n, p in ours.named_parameters())


@pytest.mark.parametrize("shape", [*SHAPES, "llama-every-bias"])
def test_each_model_holds_exactly_its_tables_parameters(shape):
    """A family's table (distlm.family.table) declares its parameters once: the model built from
    any args, whole or cut into pipeline stages, holds exactly the table's parameters, in its
    order and shapes, so the parameter count derived from the table is the model's."""
    doc = (
        {**SHAPES["llama-gqa-untied"], "attention_bias": True, "mlp_bias": True}
        if shape == "llama-every-bias"
        else SHAPES[shape]
    )
    args = model_args({**doc, "vocab_size": VOCAB}, shape)
    fam = family_of(args)
    table = fam.spec.tensors
    for cut in (None, Cut(0, 1, first=True, last=False), Cut(1, 2, first=False, last=True)):
        model = fam.build(args, cut, device="meta")
        held = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        assert held == list(table.shapes(args, cut).items()), (shape, cut)
    whole = fam.build(args, device="meta")
    assert args.parameters() == sum(p.numel() for p in whole.parameters())
    assert args.block_parameters() == sum(p.numel() for p in whole.layers["0"].parameters())
    assert all(
        table.is_first(h) or table.is_last(h) or table.layer_of(h) is not None
        for h in whole.hf_tensors()
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        LLAMA3_ROPE,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16,
            "attention_factor": 1.3,
        },
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-set"],
)
def test_rotary_frequencies_are_transformers(rope):
    """Each rotary scaling's inverse frequencies and cos/sin factor, and the positions' cos and
    sin, against transformers' rotary module of the same config."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from distlm.family.llama.blocks import Rotary

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        rope_parameters=dict(rope),
    )
    theirs = LlamaRotaryEmbedding(config)
    args = model_args(config.to_dict(), "rope")
    mine = Rotary(args)  # pyright: ignore[reportArgumentType]
    torch.testing.assert_close(mine.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    assert mine.scaling == pytest.approx(theirs.attention_scaling)
    pos = torch.arange(0, 128, 7)
    cos, sin = mine(pos, torch.float32)
    want_cos, want_sin = theirs(torch.empty(0), pos[None])
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=1e-6, atol=1e-6)
    moved = mine.to(torch.bfloat16)  # its frequencies keep float32, wherever the model goes
    assert moved.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    "doc,message",
    [
        (
            {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
            "layer_types: layers .* sliding-window attention",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type 'dynamic': its frequencies depend on the sequence's length",
        ),
        (
            {"model_type": "llama", "rope_parameters": {"rope_type": "longrope"}},
            "rope_parameters.rope_type 'longrope'",
        ),
        ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"model_type": "llama", "hidden_act": "relu2"}, "hidden_act 'relu2' is not supported"),
        ({"model_type": "gpt2", "n_embd": 30, "n_head": 4}, "n_embd is 30; expected a multiple"),
        ({"model_type": "llama", "num_key_value_heads": 3}, "num_key_value_heads is 3"),
        ({"model_type": "gpt2", "n_layer": "12"}, "n_layer is '12'; expected an integer"),
        ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
    ],
)
def test_what_the_model_cannot_run_is_refused_naming_the_key(doc, message):
    with pytest.raises(DistlmError, match=f"config.json: .*{message}"):
        model_args(doc, "x/config.json")


def test_a_pipeline_stage_is_a_range_of_the_same_blocks():
    """Blocks [1, 2) of a model hold that block under its own index (the same tensor names as
    the whole model's), and running the stages one after another gives the whole model's
    hidden states."""
    _hf, whole = models("llama-gqa-untied")
    args = whole.args
    fam = family_of(args)
    first = fam.build(args, Cut(0, 1, first=True, last=False))
    last = fam.build(args, Cut(1, 2, first=False, last=True))
    tensors = whole.hf_tensors()
    for stage in (first, last):
        mine = stage.hf_tensors()
        assert set(mine) < set(tensors)
        stage.load_hf({k: tensors[k] for k in mine}, "stage")
    assert list(last.layers) == ["1"]
    x = ids()
    pos = torch.arange(x.shape[1])
    with torch.no_grad():
        h = first.embed(x, pos)
        for stage in (first, last):
            rot = stage.positions(pos, h.dtype)
            for block in stage.blocks:
                h = block(h, rot)
        torch.testing.assert_close(last.head(h), whole(x), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_the_training_step_of_each_family_compiles_as_one_graph(family):
    """torch.compile(fullgraph=True) of the training loss, forward and backward (inductor, as on
    a GPU): no graph break, the eager loss and gradients."""
    from distlm.train.kernels import NextTokenLoss

    shape = {"gpt2": "gpt2", "llama": "smollm2-shape", "qwen2": "qwen2-qkv-bias"}.get(
        family, "qwen3-qk-norm-hd16"
    )
    _, ours = models(shape)
    ours.train()
    x = ids(batch=2, length=32)
    want = NextTokenLoss(ours)(x)
    want.backward()
    eager = {n: p.grad.clone() for n, p in ours.named_parameters()}  # pyright: ignore[reportOptionalMemberAccess]
    ours.zero_grad()
    torch._dynamo.reset()
    try:
        got = torch.compile(NextTokenLoss(ours), fullgraph=True)(x)
        got.backward()
    finally:
        torch._dynamo.reset()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-4, atol=1e-5, msg=n)


def test_optimizer_state_in_transformers_names_round_trips_and_reads_the_release_before():
    """AdamW's state as a checkpoint holds it (transformers' names: a fused projection's moments
    split as its weight is) loads back exactly; a checkpoint's of distlm before its own model
    (torch's state by index over transformers' parameters, matrices first) loads into distlm's
    model as the same moments."""
    from distlm.train.optim import param_groups
    from distlm.train.state import (
        OPTIMIZER_FORMAT,
        load_named_optimizer_state,
        named_optimizer_state,
    )

    hf, ours = models("qwen2-qkv-bias")  # fused q|k|v with biases, gate|up, tied
    x = ids()
    # the release before: AdamW over transformers' model, its groups as param_groups made them
    old = torch.optim.AdamW(param_groups(hf, 0.1), lr=1e-2)
    hf(input_ids=x, labels=x).loss.backward()
    old.step()
    legacy = old.state_dict()
    opt = torch.optim.AdamW(param_groups(ours, 0.1), lr=1e-3)
    load_named_optimizer_state(ours, opt, legacy, "optimizer.pt")
    assert opt.param_groups[0]["lr"] == 1e-2  # the checkpoint's settings
    named = named_optimizer_state(ours, opt)
    assert named["format"] == OPTIMIZER_FORMAT
    theirs = {n: old.state[p] for n, p in hf.named_parameters()}
    assert set(named["state"]) == set(theirs)
    for n, s in theirs.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(named["state"][n][k], s[k]), (n, k)
    again = torch.optim.AdamW(param_groups(ours, 0.1), lr=1e-3)
    load_named_optimizer_state(ours, again, named, "optimizer.pt")
    for p in ours.parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(again.state[p][k], opt.state[p][k])
    with pytest.raises(DistlmError, match="optimizer.pt: optimizer state of"):
        load_named_optimizer_state(
            ours, again, {**legacy, "param_groups": legacy["param_groups"][:1]}, "optimizer.pt"
        )


@pytest.mark.parametrize("shape", ["gpt2", "qwen2-qkv-bias"])
def test_loaded_optimizer_state_is_laid_out_as_its_parameter(shape):
    """Each moment loaded from a checkpoint has its parameter's shape and strides, also where
    the checkpoint holds it transposed (GPT-2's Conv1D names) and contiguous (what the pinned
    staging copies of a save on a GPU write): CUDA's fused AdamW refuses a moment laid out unlike
    its parameter, which a resumed training on the H100 of 2026-11-28 met at its first step."""
    from distlm.train.kernels import NextTokenLoss
    from distlm.train.optim import param_groups
    from distlm.train.state import load_named_optimizer_state, named_optimizer_state

    _, ours = models(shape)
    opt = torch.optim.AdamW(param_groups(ours, 0.1), lr=1e-3)
    NextTokenLoss(ours.train())(ids()).backward()
    opt.step()
    named = named_optimizer_state(ours, opt)
    staged = {
        **named,
        "state": {
            n: {k: v.contiguous() if torch.is_tensor(v) else v for k, v in st.items()}
            for n, st in named["state"].items()
        },
    }
    again = torch.optim.AdamW(param_groups(ours, 0.1), lr=1e-3)
    load_named_optimizer_state(ours, again, staged, "optimizer.pt")
    for n, p in ours.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            m = again.state[p][k]
            assert (m.shape, m.stride()) == (p.shape, p.stride()), (n, k)
            assert torch.equal(m, opt.state[p][k]), (n, k)
