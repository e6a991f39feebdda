"""Model families (distlm.family): Llama-family models (grouped-query attention with 1 and 2
KV heads, tied and untied embeddings, Llama 3.2's rope scaling, Qwen2's QKV biases) through the
model folder, the shard cut, sliding-window evaluation against the transformers perplexity guide's
loop, DDP training on 2 gloo ranks against one process, and a kill with a bit-identical resume;
a folder shaped as SmolLM2-135M ships through `model.source: local`; the config refusals."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness.faults import fault_env
from harness.synthetic import make_inputs

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.core.io import read_json, write_json
from distlm.dag.config import ConfigError, validate_config, validate_settings
from distlm.dag.stages import stage_config
from distlm.data import TokenBlocks
from distlm.evaluate import evaluate_model
from distlm.family import REGISTRY
from distlm.family.llama import RopeScalingSettings
from distlm.launch.torchrun import local_torchrun, stage_args, train_args
from distlm.model import (
    family_of,
    init_config,
    init_model,
    load_model_dir,
    load_shards,
    read_manifest,
    read_meta,
    state_dict_for_save,
    write_model_dir,
    write_pipeline_dir,
)
from distlm.model.documents import ShardManifest
from distlm.runtime.dist import distributed
from distlm.settings import init_settings
from distlm.settings.eval import EvalConfig
from distlm.settings.train import TrainConfig
from distlm.train import run_training
from distlm.train.identity import list_runs

ROOT = Path(__file__).resolve().parents[1]
BLOCK, VOCAB = 32, 256
# Llama 3.2's rope scaling, its lengths shrunk to the tiny context (Llama 3.2: 8192 of 131072)
LLAMA3 = RopeScalingSettings(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
# 3 layers of width 32, 4 query heads: every variant differs from the others where the families do
VARIANTS: dict[str, dict] = {
    "llama-kv1-tied": {"architecture": "llama", "n_kv_head": 1},
    "llama-kv2-untied": {"architecture": "llama", "n_kv_head": 2, "tie_embeddings": False},
    "llama3-rope": {"architecture": "llama", "n_kv_head": 2, "rope_scaling": LLAMA3},
    "qwen2-kv2-untied": {"architecture": "qwen2", "n_kv_head": 2, "tie_embeddings": False},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> dict:
    """Token file and model folder of one variant (make_inputs), and its name."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    inputs = make_inputs(root, n_layer=3, n_head=4, n_embd=32, vocab=VOCAB, **VARIANTS[name])
    return {"name": name, **inputs}


def test_the_families_are_the_supported_ones():
    assert set(REGISTRY) == {"gpt2", "llama", "qwen2", "qwen3"}
    with pytest.raises(DistlmError, match="'mamba' is not supported; distlm supports gpt2, llama"):
        family_of("mamba")
    for name, spec in REGISTRY.items():  # each spec's model is its family's, by the same name
        fam = family_of(name)
        assert fam.model_type == name and fam.spec is spec and fam.model.linear_logits
        assert fam.hf_model_class.__name__ == spec.architecture


def test_folder_loads_unchanged_and_shards_cut_by_family(variant, tmp_path):
    """The model folder is what the family's class writes (AutoModelForCausalLM loads it to the
    same logits); the shard cut puts the embeddings first, each decoder layer once, the final
    norm and head last, a tied head as the last stage's own copy; the shards give back the
    folder's tensors exactly."""
    from transformers import AutoModelForCausalLM

    folder = variant["model"]
    spec = VARIANTS[variant["name"]]
    config = json.loads((folder / "config.json").read_text())
    family = family_of(spec["architecture"])
    assert config["architectures"] == [family.architecture]
    assert config["num_key_value_heads"] == spec["n_kv_head"]
    assert config["tie_word_embeddings"] == spec.get("tie_embeddings", True)
    if "rope_scaling" in spec:
        assert config["rope_parameters"]["rope_type"] == "llama3"
    ours = load_model_dir(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == family.architecture
    x = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-5, atol=1e-6)

    sd = state_dict_for_save(hf)
    assert set(sd) == set(ours.hf_tensors())
    tied = "lm_head.weight" not in sd
    assert tied == spec.get("tie_embeddings", True)
    man = write_pipeline_dir(folder, tmp_path / "p", stages=2)
    assert read_manifest(tmp_path / "p") == man
    assert [s.layers for s in man.shards] == [(0, 2), (2, 3)]  # 3 layers do not divide by 2
    first, last = man.shards
    assert "model.embed_tokens.weight" in first.tensors and "model.norm.weight" in last.tensors
    assert "lm_head.weight" in last.tensors and "lm_head.weight" not in first.tensors
    assert man.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert all(
        family.tensors.layer_of(k) in (0, 1)
        for k in first.tensors
        if family.tensors.layer_of(k) is not None
    )
    assert {family.tensors.layer_of(k) for k in last.tensors} == {2, None}
    if spec["architecture"] == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in first.tensors
    back = load_shards(tmp_path / "p")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_shard_manifest_of_the_release_before_reads(tmp_path):
    """shards/manifest.json as distlm wrote it before it was a typed document reads unchanged."""
    doc = {
        "format": "distlm-shards/1",
        "stages": 1,
        "n_layer": 2,
        "model_sha256": "a" * 64,
        "tied": {"lm_head.weight": "transformer.wte.weight"},
        "shards": [
            {
                "stage": 0,
                "file": "stage-00.safetensors",
                "layers": [0, 2],
                "has_embeddings": True,
                "has_head": True,
                "tensors": ["transformer.wte.weight"],
                "bytes": 10,
                "sha256": "b" * 64,
            }
        ],
    }
    write_json(tmp_path / "shards" / "manifest.json", doc)
    man = read_manifest(tmp_path)
    assert isinstance(man, ShardManifest) and man.shards[0].layers == (0, 2)
    write_document(tmp_path / "again.json", man)
    assert read_json(tmp_path / "again.json") == doc


# ----------------------------------------------------------------------------- evaluation


def guide_perplexity(model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The transformers perplexity guide's loop (docs: "Perplexity of fixed-length models"), with
    its token count exact: the loss of each window's last `trg_len` tokens, labels masked -100."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc  # may be different from stride on last loop
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
        # the loss is the mean over the labels that are not -100, shifted by one inside the model
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(outputs.loss) * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum / n_tokens, n_tokens


def test_perplexity_equals_the_transformers_guide_loop(variant, tmp_path):
    """The eval stage's figure (distlm.evaluate, one rank) on a model with large weights (so the
    history moves the loss) equals the guide's loop on AutoModelForCausalLM, to 1e-5."""
    from transformers import AutoModelForCausalLM

    init = init_settings(
        n_layer=3, n_head=4, n_embd=32, n_positions=BLOCK, **VARIANTS[variant["name"]]
    )
    config = init_config(init, VOCAB, 0)
    config.initializer_range = 0.3
    model = init_model(config, seed=1)
    folder = tmp_path / "sharp"
    write_model_dir(
        folder,
        state_dict=state_dict_for_save(model),
        config=config,
        tokenizer_dir=variant["tokenizer"],
        meta={
            **read_meta(variant["model"]).model_dump(include={"source", "data_config_digest"}),
            "created_by": "test",
            "config_digest": "e" * 64,
            "dtype": "float32",
        },
    )
    context, stride = BLOCK, 12
    cfg = EvalConfig.of(
        {
            "runtime": {"device": "cpu", "backend": "gloo", "timeout_s": 60},
            "eval": {
                "nproc_per_node": 1,
                "context": context,
                "stride": stride,
                "batch_size": 3,
                "precision": "fp32",
                "splits": ["validation"],
            },
        }
    )
    with distributed(backend="gloo", device="cpu", timeout_s=60) as topo:
        report = evaluate_model(
            cfg,
            topo=topo,
            model_dir=folder,
            tokens_path=variant["tokens"],
            name="sharp",
            out_path=tmp_path / "eval.json",
        )
    assert report is not None
    got = report.splits["validation"]
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    stream = TokenBlocks(variant["tokens"], "validation").tokens()
    ids = torch.as_tensor(stream, dtype=torch.long)[None]
    want, n = guide_perplexity(hf, ids, context, stride)
    assert got.tokens_scored == n == ids.size(1) - 1
    assert got.mean_loss == pytest.approx(want, rel=1e-5)
    assert got.perplexity == pytest.approx(math.exp(want), rel=1e-5)
    # the windows matter: the whole stream scored with no history is far off
    blind, _ = guide_perplexity(hf, ids, context, context)
    assert abs(blind - want) / want > 1e-3


# ----------------------------------------------------------------------------- training


def train_cfg(**train) -> TrainConfig:
    cfg = validate_config(
        {
            "runtime": {"timeout_s": 60},
            "transfer": {"bucket_mb": 0.25, "chunk_mb": 0.0625, "timeout_s": 60},
            "train": {
                "max_steps": 6,
                "micro_batch_size": 4,
                "global_batch_size": 8,
                "warmup_steps": 2,
                "lr": 0.01,
                "min_lr": 0.001,
                "ckpt_every": 2,
                "eval_every": 3,
                "eval_batches": 2,
                "keep_last": 2,
                "profile": {"enabled": False},
                **train,
            },
        }
    )
    return TrainConfig.of(stage_config(cfg, "train"))


def torchrun(cfg: TrainConfig, inputs: dict, out: Path, *, restarts: int = 0, env=None):
    """The train stage's entry point on 2 gloo ranks under torchrun, as rule train starts it."""
    import os

    cfg_path = out.parent / f"{out.name}.json"
    write_document(cfg_path, cfg)
    cmd = local_torchrun(
        stage_args(
            "train",
            nproc=2,
            max_restarts=restarts,
            launcher=["--monitor-interval=0.2"],
            args=train_args(
                config=cfg_path,
                tokens=inputs["tokens"],
                tokenizer=inputs["tokenizer"],
                model=inputs["model"],
                out=out,
                rank_log=out / "logs" / "rank{rank}.log",
            ),
        )
    )
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)


def losses(out: Path) -> list[float]:
    return [float(r.split(",")[1]) for r in (out / "metrics.csv").read_text().splitlines()[1:]]


# What DDP and a resume see of a family is its parameters: tied or untied embeddings (one tensor
# under two names, or two), each family's own (Qwen2's q, k, v biases). These two variants hold
# both sides of each; the other two differ from them in the attention (KV heads, rope scaling),
# which the tests above and tests/test_family_pipeline.py compare with transformers.
DDP_VARIANTS = ["llama-kv1-tied", "qwen2-kv2-untied"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", DDP_VARIANTS, indirect=True)
def test_ddp_equals_one_process_and_a_kill_resumes_bit_identically(variant, tmp_path):
    """2 ranks x 4 blocks and 1 process x 2 micro-batches of 4 (global batch 8) train to the same
    losses to float rounding (fused linear cross-entropy on); the 2-rank run with its last rank
    SIGKILLed after step 3 (torchrun restarts it from the step-2 checkpoint) ends with the same
    bits as the run without the kill."""
    from distlm.train import TrainPaths

    cfg = train_cfg()
    a = torchrun(cfg, variant, tmp_path / "a")
    assert a.returncode == 0, a.stderr[-4000:]
    faults = fault_env(tmp_path / "faults.json", kill_after_step=3)
    b = torchrun(cfg, variant, tmp_path / "b", restarts=1, env=faults)
    assert b.returncode == 0, b.stderr[-4000:]
    assert "killing rank 1" in (tmp_path / "b" / "logs" / "rank1.log").read_text()
    assert "resuming from" in (tmp_path / "b" / "logs" / "rank0.log").read_text()
    wa = load_model_dir(tmp_path / "a" / "final").state_dict()
    wb = load_model_dir(tmp_path / "b" / "final").state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda p: [",".join(r.split(",")[:6]) for r in p.read_text().splitlines()]
    assert strip(tmp_path / "a" / "metrics.csv") == strip(tmp_path / "b" / "metrics.csv")
    assert read_meta(tmp_path / "b" / "final").training["restart_count"] == 1

    one = tmp_path / "one"
    run_training(
        cfg,
        TrainPaths(
            tokens=variant["tokens"],
            model=variant["model"],
            tokenizer=variant["tokenizer"],
            out=one,
        ),
    )
    assert len(list_runs(one / "checkpoints")) == 1
    two_ranks = losses(tmp_path / "a")
    assert len(two_ranks) == 6 and two_ranks[-1] < two_ranks[0]  # the loss falls
    assert losses(one) == pytest.approx(two_ranks, rel=1e-5)
    final = load_model_dir(one / "final").state_dict()
    for k in wa:
        torch.testing.assert_close(final[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_fused_loss_matches_transformers_for_the_llama_family(variant):
    """train.fast_kernels on the CPU for a Llama-family model: the fused linear cross-entropy
    over distlm's model gives transformers' loss and gradients to float rounding."""
    from transformers import AutoModelForCausalLM

    from distlm.train.kernels import CausalLMLoss

    ref = AutoModelForCausalLM.from_pretrained(variant["model"], dtype=torch.float32).train()
    fast = load_model_dir(variant["model"]).train()
    x = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=x, labels=x).loss
    want.backward()
    got = CausalLMLoss(fast)(x)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    grads = fast.tensor_map().to_hf({n: p.grad for n, p in fast.named_parameters()})
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # and transformers' loss is the cross-entropy of its logits (no hidden scaling)
    with torch.no_grad():
        logits = ref(x).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    assert want.item() == pytest.approx(ce.item(), rel=1e-5)


# ----------------------------------------------------------------------------- config


def test_init_keys_are_checked_and_gpt2_configs_hash_as_before():
    base = validate_settings({})
    # GPT-2 (the default) dumps no architecture and none of the Llama family's keys
    assert set(base.model.init.model_dump()) == {
        "n_layer",
        "n_head",
        "n_embd",
        "n_positions",
        "dropout",
        "seed",
    }
    same = validate_settings({"model": {"init": {"architecture": "gpt2"}}})
    assert stage_config(same.model_dump(), "model") == stage_config(base.model_dump(), "model")
    bad = {
        "model.init.n_kv_head: a key of architecture llama, qwen2, qwen3, not gpt2": {
            "n_kv_head": 2
        },
        "model.init.head_dim: a key of architecture qwen3, not llama": {
            "architecture": "llama",
            "head_dim": 64,
        },
        "model.init.head_dim: 15 is odd": {"architecture": "qwen3", "head_dim": 15},
        "model.init.n_kv_head: model.init.n_head 4 is not divisible by n_kv_head 3": {
            "architecture": "llama",
            "n_kv_head": 3,
        },
        "model.init.rope_scaling.original_max_position_embeddings: 8192 must be less": {
            "architecture": "llama",
            "rope_scaling": {},
        },
        "model.init.n_head: head width n_embd / n_head = 3 is odd": {
            "architecture": "qwen2",
            "n_embd": 12,
            "n_head": 4,
        },
        "model.init.architecture": {"architecture": "mistral"},
    }
    for message, init in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            validate_settings({"model": {"init": init}})
    llama = validate_settings({"model": {"init": {"architecture": "llama", "n_kv_head": 2}}})
    assert llama.model.init.model_dump()["architecture"] == "llama"
    # Qwen3: a head width of its own, so n_head need not divide n_embd (q_proj: 32 -> 4 x 16)
    qwen3 = {"architecture": "qwen3", "n_embd": 32, "n_head": 4, "n_kv_head": 2, "head_dim": 16}
    s = validate_settings({"model": {"init": qwen3}})
    assert type(s.model.init).__name__ == "Qwen3Init" and s.model.init.head_dim == 16
    config = init_config(s.model.init, VOCAB, 0)
    args = family_of(config).args(config.to_dict(), "qwen3")
    assert config.head_dim == 16 and (args.n_kv_heads, args.head_dim) == (2, 16)


def test_a_local_folder_of_another_type_is_refused_when_the_config_is_validated(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mamba", "num_hidden_layers": 2})
    )
    with pytest.raises(
        ConfigError, match="model_type 'mamba' is not supported; distlm supports gpt2, llama, qwen2"
    ):
        validate_settings({"model": {"source": "local", "name": str(tmp_path)}})


def test_shipped_smollm2_config_validates():
    from distlm.dag.config import load_settings

    s = load_settings(ROOT / "config" / "smollm2-135m.yaml")
    assert (s.model.source, s.model.name) == ("hub", "HuggingFaceTB/SmolLM2-135M")


def test_the_first_stage_refuses_a_model_of_another_type(tmp_path):
    """A hub model's type is known only once its config is fetched: the data stage, the first to
    read the model, refuses it before tokenizing (here a local folder stands in for the hub)."""
    from distlm.data.tokenizer import model_tokenizer
    from distlm.settings import ModelSourceSettings

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(
        DistlmError, match="'gpt_neox' is not supported; distlm supports gpt2, llama"
    ):
        model_tokenizer(ModelSourceSettings(source="local", name=str(tmp_path)))
