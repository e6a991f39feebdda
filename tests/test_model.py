"""Model serialize and pipeline shards: sources, shards that round-trip exactly, corrupt files named."""

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from distlm import DistlmError
from distlm.core.io import read_json, sha256_file
from distlm.dag.config import deep_merge, validate_config, validate_settings
from distlm.data import prepare
from distlm.model import (
    WEIGHTS,
    family_of,
    init_config,
    init_model,
    load_model_dir,
    load_safetensors,
    load_shards,
    load_source,
    load_stage_shard,
    plan_stages,
    read_manifest,
    read_meta,
    serialize,
    state_dict_for_save,
    verify_model_folder,
    write_model_dir,
    write_pipeline_dir,
)
from distlm.settings import ModelSourceSettings, Settings, init_settings
from distlm.settings.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "data": {"block_size": 32, "tokenizer": {"vocab_size": 400}},
    "model": {"init": {"n_layer": 5, "n_head": 2, "n_embd": 32, "n_positions": 64}},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    c = validate_settings(BASE)
    prepare(
        c.data,
        c.model,
        tokens_path=out / "tokens.h5",
        tokenizer_dir=out / "tokenizer",
        stats_path=out / "stats.json",
    )
    return out


def model_config(c: Settings) -> ModelConfig:
    """The model stage's document of validated settings (as the rule's params hold it)."""
    return ModelConfig.of({"model": c.model.model_dump(mode="json")})


def make(tmp_path, data, stages, **model):
    """A serialized model folder and its pipeline folder of `stages` shards."""
    c = validate_settings(deep_merge(BASE, {"model": model}))
    folder = tmp_path / "model"
    serialize(
        model_config(c),
        tokenizer_dir=data / "tokenizer",
        tokens_path=data / "tokens.h5",
        out_dir=folder,
    )
    out = tmp_path / f"pipeline-{stages}"
    write_pipeline_dir(folder, out, stages=stages)
    return out, read_json(out / "distlm.json")


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_shards_round_trip_exactly(tmp_path, data, stages):
    out, meta = make(tmp_path, data, stages)
    full = load_safetensors(tmp_path / "model" / "model.safetensors")
    back = load_shards(out)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) and back[k].dtype == full[k].dtype for k in full)
    man = read_manifest(out)
    assert man.shards[0].layers[0] == 0 and man.shards[-1].layers[1] == 5
    assert man.shards[0].has_embeddings and man.shards[-1].has_head
    assert [s.has_embeddings for s in man.shards].count(True) == 1
    assert [s.has_head for s in man.shards].count(True) == 1
    # Contiguous, non-empty layer ranges; every block in exactly one shard.
    ranges = [s.layers for s in man.shards]
    assert all(a < b for a, b in ranges) and all(
        ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)
    )
    # The last stage carries its own copy of the tied embedding as lm_head.weight.
    _, last = load_stage_shard(out, stages - 1)
    assert torch.equal(last["lm_head.weight"], full["transformer.wte.weight"])
    assert meta["stages"][0]["layers"] == list(man.shards[0].layers)
    assert (
        meta["source_model"] == str(tmp_path / "model") and not (out / "model.safetensors").exists()
    )


def test_serialize_reads_only_the_model_keys(data, tmp_path):
    """The model stage gets exactly its declared keys (distlm.dag.stages): no inference, no data."""
    from distlm.dag.stages import stage_config

    params = stage_config(validate_config(BASE), "model")
    assert set(params) == {"model"}
    meta = serialize(
        ModelConfig.of(params),
        tokenizer_dir=data / "tokenizer",
        tokens_path=data / "tokens.h5",
        out_dir=tmp_path / "m",
    )
    assert meta.created_by == "model" and not (tmp_path / "m" / "shards").exists()


def test_sharding_refuses_a_tampered_model_and_too_many_stages(tmp_path, data):
    out, _ = make(tmp_path, data, 2)
    with pytest.raises(DistlmError, match="stages for a model with 5 layers"):
        write_pipeline_dir(tmp_path / "model", tmp_path / "p9", stages=9)
    assert not (tmp_path / "p9").exists()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(DistlmError, match="does not match"):
        write_pipeline_dir(tmp_path / "model", out, stages=3)
    assert read_manifest(out).stages == 2  # the earlier pipeline folder is intact


def test_model_folder_loads_back_as_the_same_model(tmp_path, data):
    make(tmp_path, data, 2)
    out = tmp_path / "model"
    m = load_model_dir(out)
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

    again = init_model(AutoConfig.from_pretrained(out), seed=0)  # model.init.seed = 0
    saved = load_safetensors(out / WEIGHTS)  # the seeded init's bits
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in saved.items())
    x = torch.randint(0, m.args.vocab_size, (2, 16))
    hf = GPT2LMHeadModel.from_pretrained(out).eval()  # a valid Hugging Face folder too
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), rtol=1e-5, atol=1e-5)
    assert len(AutoTokenizer.from_pretrained(out)) == m.args.vocab_size


@pytest.mark.parametrize("folder", ["model", "pipeline-2"])
def test_folders_carry_what_save_pretrained_writes(tmp_path, data, folder):
    """Base, trained (same writer) and pipeline folders load in the ecosystem unchanged: config.json
    names the architecture, generation_config.json and the tokenizer's special tokens are there."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    make(tmp_path, data, 2)
    out = tmp_path / folder
    written = read_json(out / "config.json")
    assert written["architectures"] == ["GPT2LMHeadModel"]
    assert written["dtype"] == "float32"
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == gen.bos_token_id == written["eos_token_id"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == written["eos_token_id"]
    assert AutoConfig.from_pretrained(out).architectures == ["GPT2LMHeadModel"]
    if folder == "model":  # the pipeline folder holds shards, not model.safetensors
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        ref = load_model_dir(out)
        x = torch.randint(0, written["vocab_size"], (1, 12))
        assert type(hf).__name__ == "GPT2LMHeadModel"
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ref(x), rtol=1e-5, atol=1e-5)


def test_balance_by_bytes():
    # GPT-2-small-shaped: embeddings weigh ~5.5 blocks, so the end stages get fewer blocks.
    cfg = init_config(
        init_settings(n_layer=12, n_head=12, n_embd=768, n_positions=1024, dropout=0.0),
        50257,
        50256,
    )
    args = family_of(cfg).args(cfg.to_dict(), "gpt2")
    with torch.device("meta"):
        sd = family_of(args).model(args).hf_tensors()
    cut = {"family": family_of(args), "tied": family_of(args).tied(args)}
    plans = plan_stages(sd, 12, 3, **cut)
    sizes = [p.nbytes for p in plans]
    assert [p.cut.end - p.cut.start for p in plans] == [2, 8, 2]
    assert max(sizes) / min(sizes) < 1.2
    with pytest.raises(DistlmError, match="13 stages for a model with 12 layers"):
        plan_stages(sd, 12, 13, **cut)


def test_corrupt_and_truncated_weights_are_named(tmp_path, data):
    pipeline, _ = make(tmp_path, data, 2)
    out = tmp_path / "model"
    w = out / "model.safetensors"
    good = w.read_bytes()
    w.write_bytes(good[: len(good) // 2])
    with pytest.raises(DistlmError, match="model.safetensors: sha256 .* does not match"):
        load_model_dir(out)
    with pytest.raises(DistlmError, match="model.safetensors: corrupt or truncated"):
        load_safetensors(w)
    w.write_bytes(b"\x00" * 7)
    with pytest.raises(DistlmError, match="corrupt or truncated"):
        load_safetensors(w)
    w.write_bytes(good)
    shard = pipeline / "shards" / "stage-01.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(
        DistlmError, match=r"stage-01.safetensors: sha256 .* manifest.* \(stage 1\)"
    ):
        load_stage_shard(pipeline, 1)


def test_tensor_mismatch_is_named(tmp_path, data):
    make(tmp_path, data, 1)
    out = tmp_path / "model"
    cfg = json.loads((out / "config.json").read_text())
    cfg["n_embd"] = 64
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DistlmError, match="tensor 'transformer.wte.weight' has shape"):
        load_model_dir(out, verify=False)


def test_local_model_folder_source(tmp_path, data):
    """A Hugging Face folder (save_pretrained) brings its own weights and tokenizer."""
    src = tmp_path / "hf-model"
    from transformers import AutoTokenizer

    cfg = init_config(
        init_settings(n_layer=3, n_head=2, n_embd=32, n_positions=64, dropout=0.0), 400, 0
    )
    model = init_model(cfg, seed=7)
    model.save_pretrained(src)
    AutoTokenizer.from_pretrained(data / "tokenizer").save_pretrained(src)
    c = validate_settings(
        deep_merge(
            BASE, {"model": {"source": "local", "name": str(src)}, "inference": {"stages": 3}}
        )
    )
    d = tmp_path / "d"
    stats = prepare(
        c.data,
        c.model,
        tokens_path=d / "tokens.h5",
        tokenizer_dir=d / "tokenizer",
        stats_path=d / "stats.json",
    )
    assert stats.tokenizer.startswith("the model's own")
    out = tmp_path / "out"
    meta = serialize(
        model_config(c), tokenizer_dir=d / "tokenizer", tokens_path=d / "tokens.h5", out_dir=out
    )
    assert meta.source["source"] == "local"
    ref = state_dict_for_save(model)
    got = load_safetensors(out / "model.safetensors")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_unknown_hub_model_offline_is_named(hub_offline):
    with pytest.raises(DistlmError, match="model.name 'no-such-org/no-such-model-xyz'"):
        load_source(ModelSourceSettings(source="hub", name="no-such-org/no-such-model-xyz"))
    with pytest.raises(DistlmError, match="model folder not found"):
        load_source(ModelSourceSettings(source="local", name="/nonexistent/folder"))


def test_failed_write_leaves_nothing_that_looks_complete(tmp_path, data):
    make(tmp_path, data, 2)
    out = tmp_path / "model"
    before = (out / "model.safetensors").read_bytes()
    cfg = init_config(
        init_settings(n_layer=2, n_head=2, n_embd=32, n_positions=64, dropout=0.0), 400, 0
    )
    sd = state_dict_for_save(init_model(cfg, seed=1))
    with pytest.raises(DistlmError):
        write_model_dir(out, state_dict=sd, config=cfg, tokenizer_dir=tmp_path / "nope", meta={})
    with pytest.raises(ValidationError):  # fails mid-way: a meta that is not a ModelMeta's part
        write_model_dir(
            out, state_dict=sd, config=cfg, tokenizer_dir=data / "tokenizer", meta={"x": object()}
        )
    assert (out / "model.safetensors").read_bytes() == before  # the old folder is intact
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp left behind
    assert read_json(out / "distlm.json")["created_by"] == "model"


# ----------------------------------------------------------------------------- distlm.json


def _edit_meta(folder, edit) -> None:
    meta = read_json(folder / "distlm.json")
    edit(meta)
    (folder / "distlm.json").write_text(json.dumps(meta))


def _every_reader(folder, tmp_path):
    """Every stage's way into a model folder: loading it (train, eval), cutting it into shards,
    and the broadcast stage's sender (it checks the folder before it needs its peers)."""
    from types import SimpleNamespace

    from distlm.broadcast import run_broadcast_stage
    from distlm.dag.config import load_config
    from distlm.dag.stages import stage_config
    from distlm.settings.transfer import BroadcastConfig

    cfg = BroadcastConfig.of(
        stage_config(load_config(ROOT / "tests/configs/tiny.yaml"), "broadcast")
    )
    topo = SimpleNamespace(is_main=True, device=torch.device("cpu"), world_size=1)
    return {
        "load_model_dir": lambda: load_model_dir(folder),
        "verify_model_folder": lambda: verify_model_folder(folder),
        "write_pipeline_dir": lambda: write_pipeline_dir(folder, tmp_path / "p", stages=2),
        "broadcast": lambda: run_broadcast_stage(
            cfg, topo=topo, model_dir=folder, report_path=tmp_path / "r.json"
        ),
    }


@pytest.mark.parametrize(
    "case, edit, error",
    [
        (
            "missing hash",
            lambda m: m.pop("model_sha256"),
            r"distlm.json: malformed ModelMeta: field model_sha256: Field required",
        ),
        (
            "null hash",
            lambda m: m.__setitem__("model_sha256", None),
            r"distlm.json: malformed ModelMeta: field model_sha256",
        ),
        (
            "tampered hash",
            lambda m: m.__setitem__("model_sha256", "0" * 64),
            r"model.safetensors: sha256 [0-9a-f]{64} does not match .*distlm.json \(0{64}\)",
        ),
        (
            "unknown version",
            lambda m: m.__setitem__("format", "distlm-model/9"),
            (
                r"distlm.json: a 'distlm-model/9' document where 'distlm-model/1' \(ModelMeta\) "
                r"was expected; it was written by another version of distlm"
            ),
        ),
        (
            "not a model folder's",
            lambda m: m.__setitem__("format", "distlm-eval/2"),
            r"distlm.json: a 'distlm-eval/2' document where 'distlm-model/1'",
        ),
    ],
)
def test_one_verify_rule_for_every_reader(tmp_path, data, case, edit, error):
    """A model folder is checked one way wherever it is read: a missing, null or wrong hash and a
    distlm.json of another kind or version are refused, naming the file."""
    make(tmp_path, data, 1)
    folder = tmp_path / "model"
    assert verify_model_folder(folder).model_sha256 == sha256_file(folder / "model.safetensors")
    _edit_meta(folder, edit)
    for name, read in _every_reader(folder, tmp_path).items():
        with pytest.raises(DistlmError, match=error):
            read()
        assert not (tmp_path / "p").exists() and not (tmp_path / "r.json").exists(), name


def test_missing_weights_and_metadata_are_named(tmp_path, data):
    make(tmp_path, data, 1)
    folder = tmp_path / "model"
    (folder / "model.safetensors").unlink()
    with pytest.raises(DistlmError, match=r"model.safetensors: weights file not found \(named by"):
        verify_model_folder(folder)
    (folder / "distlm.json").unlink()
    with pytest.raises(DistlmError, match=r"ModelMeta not found: .*distlm.json"):
        verify_model_folder(folder)


def test_a_local_source_folder_distlm_wrote_is_verified_on_import(tmp_path, data):
    """model.source: local on a folder distlm wrote: the model stage checks its hash first."""
    make(tmp_path, data, 1)
    src = tmp_path / "model"
    c = validate_settings(deep_merge(BASE, {"model": {"source": "local", "name": str(src)}}))
    out = tmp_path / "imported"
    meta = serialize(
        model_config(c),
        tokenizer_dir=data / "tokenizer",
        tokens_path=data / "tokens.h5",
        out_dir=out,
    )
    assert meta.model_sha256 == read_meta(src).model_sha256  # the same weights, re-recorded
    _edit_meta(src, lambda m: m.__setitem__("model_sha256", "0" * 64))
    with pytest.raises(DistlmError, match=r"model.safetensors: sha256 .* does not match"):
        serialize(
            model_config(c),
            tokenizer_dir=data / "tokenizer",
            tokens_path=data / "tokens.h5",
            out_dir=tmp_path / "again",
        )
    assert not (tmp_path / "again").exists()


# What the model stage of distlm before these documents wrote as distlm.json (its keys, and
# their order): a folder of that release must read unchanged, so an upgrade reruns nothing.
MAIN_META = {
    "format": "distlm-model/1",
    "created_by": "model",
    "source": {"kind": "init", "seed": 0},
    "config_digest": "a" * 64,
    "data_config_digest": "b" * 64,
    "dtype": "float32",
    "model_sha256": None,  # filled in below
    "n_layer": 5,
    "n_positions": 64,
    "vocab_size": 400,
    "parameters": 1,
    "arch_digest": "c" * 64,
}


def test_a_folder_of_the_release_before_reads_and_writes_the_same(tmp_path, data):
    make(tmp_path, data, 1)
    folder = tmp_path / "model"
    old = {**MAIN_META, "model_sha256": sha256_file(folder / "model.safetensors")}
    (folder / "distlm.json").write_text(json.dumps(old, indent=2))
    meta = verify_model_folder(folder)
    assert meta.training is None and meta.to_json() == old  # no key added, none lost
    assert list(meta.to_json()) == list(old)
    trained = {**old, "created_by": "train", "training": {"steps": 3}}
    (folder / "distlm.json").write_text(json.dumps(trained))
    assert read_meta(folder).training == {"steps": 3}
    assert read_meta(folder).to_json() == trained
