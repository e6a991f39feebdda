"""Checkpoint evaluation: window arithmetic, bad inputs, and the distributed result (1 and 2 gloo
ranks, stride < context and stride = context) against a single-process reference written directly
with the model's forward and cross-entropy."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from harness.synthetic import write_tokens

from distlm import DistlmError
from distlm.core.io import read_json, sha256_file, write_json
from distlm.dag.config import ConfigError, load_config
from distlm.data import TokenBlocks, read_tokens_meta
from distlm.data.documents import TokenMeta
from distlm.evaluate import (
    check_data_matches,
    evaluate_model,
    evaluate_stream,
    load_model,
    resolve_window,
    sliding_windows,
)
from distlm.model import (
    init_model,
    load_safetensors,
    read_meta,
    save_safetensors,
    state_dict_for_save,
    write_model_dir,
)
from distlm.runtime.device import DeviceBackend, resolve_precision
from distlm.runtime.dist import distributed, free_port
from distlm.settings import EvalSettings
from distlm.settings.eval import EvalConfig

ROOT = Path(__file__).resolve().parents[1]
VOCAB, N_POSITIONS = 61, 32
SPLIT_LENGTHS = {"train": 64, "validation": 203, "test": 20}  # test: shorter than one window
# (context, stride) as configured: stride < context (not dividing the stream), stride = context,
# and both null (context = the model's n_positions, stride = context).
CASES = [(16, 5), (32, 32), (None, None)]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny GPT-2 model folder and a token file with a long and a short evaluation split."""
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    streams = {s: rng.integers(0, VOCAB, n).astype(np.int64) for s, n in SPLIT_LENGTHS.items()}
    data_meta = TokenMeta(
        source={"kind": "synthetic"},
        config_digest="d" * 64,
        tokenizer="none",
        vocab_size=VOCAB,
        eos_token_id=None,
        block_size=8,
    )
    write_tokens(root / "tokens.h5", streams, 8, VOCAB, data_meta)
    # A large init range makes the logits depend strongly on the history, so a window that scores
    # the wrong tokens or sees the wrong context moves the loss far beyond the tolerance.
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        n_embd=16,
        n_layer=2,
        n_head=2,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = init_model(config, seed=0)
    (root / "tok").mkdir()
    write_model_dir(
        root / "model",
        state_dict=state_dict_for_save(model),
        config=config,
        tokenizer_dir=root / "tok",
        meta={
            "created_by": "test",
            "source": {"kind": "init", "seed": 0},
            "config_digest": "e" * 64,
            "data_config_digest": data_meta.config_digest,
            "dtype": "float32",
        },
    )
    return {"root": root, "model": root / "model", "tokens": root / "tokens.h5", "streams": streams}


def eval_cfg(context, stride, **over) -> EvalConfig:
    ev = {
        "nproc_per_node": 1,
        "context": context,
        "stride": stride,
        "batch_size": 3,
        "precision": "fp32",
        "splits": ["validation", "test"],
        **over,
    }
    return EvalConfig.of(
        {"runtime": {"device": "cpu", "backend": "gloo", "timeout_s": 60}, "eval": ev}
    )


def reference(folder: Path, tokens: np.ndarray, context: int, stride: int) -> tuple[float, int]:
    """(mean loss, tokens scored): the HF guide's loop over transformers' model of the folder,
    one window at a time, full forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids_all = torch.as_tensor(tokens, dtype=torch.long)
    nll, n, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids_all), stride):
        end = min(begin + context, len(ids_all))
        trg_len = end - prev_end  # the tokens this window scores: [end - trg_len, end)
        ids = ids_all[begin:end]
        with torch.no_grad():
            logits = model(ids[None]).logits[0]  # (T, V)
        losses = F.cross_entropy(logits[:-1], ids[1:], reduction="none")  # predicts ids[1:]
        first = max(end - trg_len - begin - 1, 0)  # losses[p] is token begin + p + 1
        nll += float(losses[first:].double().sum())
        n += len(losses) - first
        prev_end = end
        if end == len(ids_all):
            break
    return nll / n, n


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _rank_main(rank: int, world: int, port: int, model_dir: str, tokens: str, out_dir: str) -> None:
    """One rank: evaluate_model for every case, rank 0 writes one JSON per case."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with distributed(backend="gloo", device="cpu", timeout_s=60) as topo:
        for i, (context, stride) in enumerate(CASES):
            evaluate_model(
                eval_cfg(context, stride),
                topo=topo,
                model_dir=model_dir,
                tokens_path=tokens,
                name=f"case{i}",
                out_path=Path(out_dir) / f"case{i}.json",
            )


@pytest.fixture(scope="module")
def runs(tiny) -> dict[int, list[dict]]:
    """evaluate_model under 1 rank (in this process) and 2 gloo ranks (spawned processes)."""
    out = {}
    for world in (1, 2):
        d = tiny["root"] / f"world{world}"
        d.mkdir()
        args = (world, free_port(), str(tiny["model"]), str(tiny["tokens"]), str(d))
        saved = dict(os.environ)
        try:
            if world == 1:
                _rank_main(0, *args)
            else:
                mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out[world] = [read_json(d / f"case{i}.json") for i in range(len(CASES))]
    return out


# ----------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n", [2, 7, 16, 17, 100, 203])
@pytest.mark.parametrize("context,stride", [(16, 1), (16, 5), (16, 8), (16, 16), (2, 2), (2, 1)])
def test_windows_score_every_token_once(n, context, stride):
    ws = sliding_windows(n, context, stride)
    scored = [t for w in ws for t in range(w.target, w.end)]
    assert scored == sorted(set(scored)), "a token is scored twice or out of order"
    assert ws[0].begin == 0 and ws[-1].end == n
    for prev, w in itertools.pairwise(ws):
        assert w.begin == prev.begin + stride and w.target == max(prev.end, w.begin + 1)
    for w in ws:
        assert 0 < w.end - w.begin <= context and w.begin < w.target <= w.end
    # stride < context: every token but the first is scored; stride = context: all but window starts
    lost = set(range(n)) - set(scored)
    assert lost == ({0} if stride < context else {w.begin for w in ws})


def test_windows_bad_arguments():
    with pytest.raises(DistlmError, match="eval.stride"):
        sliding_windows(100, 16, 17)
    with pytest.raises(DistlmError, match="eval.context"):
        sliding_windows(100, 1, 1)
    with pytest.raises(DistlmError, match="split 'x': 1 token"):
        sliding_windows(1, 16, 8, where="split 'x'")


def test_resolve_window_defaults_and_limits():
    assert resolve_window(EvalSettings(), 1024) == (1024, 1024)
    assert resolve_window(EvalSettings(stride=512), 1024) == (1024, 512)
    assert resolve_window(EvalSettings(context=64), 128) == (64, 64)
    with pytest.raises(DistlmError, match="eval.context: 256 is beyond"):
        resolve_window(EvalSettings(context=256), 128, where="results/model/base")
    with pytest.raises(DistlmError, match="eval.stride: 2048 is larger"):
        resolve_window(EvalSettings(stride=2048), 1024)


def test_config_rejects_stride_beyond_context():
    with pytest.raises(ConfigError, match="eval.stride: 65 is larger than eval.context 64"):
        load_config(ROOT / "config" / "config.yaml", {"eval": {"context": 64, "stride": 65}})
    with pytest.raises(ConfigError, match="eval.stride"):
        load_config(ROOT / "config" / "config.yaml", {"eval": {"stride": 0}})
    # context null = the model's n_positions (256 in config.yaml's init model)
    with pytest.raises(ConfigError, match=r"eval.stride: 300 is larger than the context"):
        load_config(ROOT / "config" / "config.yaml", {"eval": {"context": None, "stride": 300}})
    cfg = load_config(ROOT / "config" / "config.yaml", {"eval": {"context": None, "stride": 256}})
    assert (cfg["eval"]["context"], cfg["eval"]["stride"]) == (None, 256)


def test_precision():
    cpu = torch.device("cpu")
    for asked, dtype in (("auto", None), ("fp32", None), ("bf16", torch.bfloat16)):
        hw = DeviceBackend(cpu, resolve_precision(asked, cpu, key="eval.precision"))
        assert hw.autocast_dtype is dtype


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_distributed_equals_reference(tiny, runs, world, case):
    res = runs[world][case]
    context = CASES[case][0] or N_POSITIONS
    stride = CASES[case][1] or context
    assert (res["context"], res["stride"], res["world_size"]) == (context, stride, world)
    for split in ("validation", "test"):
        tokens = tiny["streams"][split]
        ref_loss, ref_n = reference(tiny["model"], tokens, context, stride)
        got = res["splits"][split]
        assert got["tokens_scored"] == ref_n
        assert rel(got["mean_loss"], ref_loss) < 1e-5, (split, got["mean_loss"], ref_loss)
        assert rel(got["perplexity"], math.exp(ref_loss)) < 1e-5
    if context > SPLIT_LENGTHS["test"]:  # a split shorter than a window is one shorter window
        assert res["splits"]["test"]["windows"] == 1
        assert res["splits"]["test"]["tokens_scored"] == SPLIT_LENGTHS["test"] - 1


def test_result_independent_of_world_size_and_method_sensitive(runs):
    for case in range(len(CASES)):
        one, two = runs[1][case]["splits"], runs[2][case]["splits"]
        for split in one:
            assert rel(two[split]["mean_loss"], one[split]["mean_loss"]) < 1e-6
            assert two[split]["tokens_scored"] == one[split]["tokens_scored"]
    # The windows matter: a shorter history (stride = context) gives a clearly different loss,
    # so the comparisons above could not pass with the wrong windows.
    a, b = runs[1][0]["splits"]["validation"], runs[1][1]["splits"]["validation"]
    assert rel(a["mean_loss"], b["mean_loss"]) > 1e-3


def test_output_json(tiny, runs):
    res = runs[2][1]
    meta = read_json(tiny["model"] / "distlm.json")
    assert res["format"] == "distlm-eval/2" and res["name"] == "case1"
    assert res["model"]["model_sha256"] == meta["model_sha256"]
    assert res["data"]["sha256"] == sha256_file(tiny["tokens"])
    assert res["precision"] == "fp32" and res["device"] == "cpu"
    for split, r in res["splits"].items():
        assert r["model_sha256"] == meta["model_sha256"]
        assert r["tokens"] == SPLIT_LENGTHS[split]
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0
        assert r["perplexity"] == pytest.approx(math.exp(r["mean_loss"]), rel=1e-12)
        import hashlib

        assert r["tokens_sha256"] == hashlib.sha256(tiny["streams"][split].tobytes()).hexdigest()


def test_reduced_precision_close_to_fp32(tiny):
    model, _ = load_model(tiny["model"], torch.device("cpu"))
    tokens = TokenBlocks(tiny["tokens"], "validation").tokens()
    from distlm.runtime.dist import Topology

    topo = Topology(
        rank=0, world_size=1, local_rank=0, backend="gloo", device_backend=DeviceBackend.cpu()
    )
    fp32 = evaluate_stream(model, tokens, context=16, stride=5, batch_size=4, topo=topo)
    bf16 = evaluate_stream(
        model, tokens, context=16, stride=5, batch_size=4, topo=topo, autocast_dtype=torch.bfloat16
    )
    assert bf16.tokens_scored == fp32.tokens_scored
    assert rel(bf16.mean_loss, fp32.mean_loss) < 2e-2


# ----------------------------------------------------------------------------- bad inputs


def _copy_model(tiny, name: str) -> Path:
    dst = tiny["root"] / name
    shutil.copytree(tiny["model"], dst)
    return dst


def _rewrite_weights(folder: Path, edit) -> None:
    """Change model.safetensors and re-seal it: the digest matches, the tensors do not."""
    sd = load_safetensors(folder / "model.safetensors")
    edit(sd)
    save_safetensors(sd, folder / "model.safetensors")
    meta = read_json(folder / "distlm.json")
    meta["model_sha256"] = sha256_file(folder / "model.safetensors")
    write_json(folder / "distlm.json", meta)


def test_checkpoint_tensor_shape_mismatch_names_tensor(tiny):
    folder = _copy_model(tiny, "bad-shape")
    name = "transformer.h.1.mlp.c_fc.weight"
    _rewrite_weights(folder, lambda sd: sd.__setitem__(name, torch.zeros(16, 32)))
    with pytest.raises(DistlmError, match=rf"tensor '{name}' has shape \(16, 32\)"):
        load_model(folder, torch.device("cpu"))


def test_checkpoint_missing_tensor_names_tensor(tiny):
    folder = _copy_model(tiny, "bad-missing")
    _rewrite_weights(folder, lambda sd: sd.pop("transformer.h.0.attn.c_attn.bias"))
    with pytest.raises(DistlmError, match="missing tensor 'transformer.h.0.attn.c_attn.bias'"):
        load_model(folder, torch.device("cpu"))


def test_checkpoint_config_mismatch_names_tensor(tiny):
    folder = _copy_model(tiny, "bad-config")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["n_embd"] = 24
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DistlmError, match=r"tensor 'transformer\.[\w.]+' has shape"):
        load_model(folder, torch.device("cpu"))


def test_checkpoint_digest_mismatch(tiny):
    folder = _copy_model(tiny, "bad-digest")
    sd = load_safetensors(folder / "model.safetensors")
    sd["transformer.ln_f.bias"] = sd["transformer.ln_f.bias"] + 1
    save_safetensors(sd, folder / "model.safetensors")
    with pytest.raises(DistlmError, match="sha256 .* does not match"):
        load_model(folder, torch.device("cpu"))


def test_missing_model_folder(tiny):
    with pytest.raises(DistlmError, match="model folder not found"):
        load_model(tiny["root"] / "nope", torch.device("cpu"))


def test_data_from_another_config_is_refused(tiny):
    with pytest.raises(DistlmError, match="made from data with config digest"):
        check_data_matches(
            read_meta(tiny["model"]).model_copy(update={"data_config_digest": "a" * 64}),
            read_tokens_meta(tiny["tokens"]),
            tiny["model"],
            tiny["tokens"],
        )
    check_data_matches(
        read_meta(tiny["model"]), read_tokens_meta(tiny["tokens"]), tiny["model"], tiny["tokens"]
    )


def test_token_beyond_vocabulary(tiny):
    model, _ = load_model(tiny["model"], torch.device("cpu"))
    from distlm.runtime.dist import Topology

    topo = Topology(
        rank=0, world_size=1, local_rank=0, backend="gloo", device_backend=DeviceBackend.cpu()
    )
    with pytest.raises(DistlmError, match=f"token id {VOCAB} is outside the model's vocabulary"):
        evaluate_stream(
            model, np.array([1, 2, VOCAB]), context=16, stride=8, batch_size=2, topo=topo, where="s"
        )
