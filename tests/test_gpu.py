"""Every stage on CUDA, through the user's commands: the whole workflow on config/gpu.yaml (one
GPU finishes it, the broadcast and the report included), training in bf16 under torch.compile,
a training killed and resumed, evaluation, batch inference whose greedy output equals
transformers' `generate` on the GPU at one and two stages, and a real request to the server.

Marker `gpu`; every test skips without CUDA (CI and the CPU machines). `benchmarks/gpu/run.sh`
runs them on a GPU machine (`pytest -m gpu`), after its own run of config/gpu.yaml, which it names
in DISTLM_TESTS_GPU_WORKFLOW so that the tests read that run instead of making another. Without
it the session runs config/gpu.yaml with fewer steps (GPU_QUICK) once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, copy_workflow, recent_logs, run_snakemake
from harness.faults import fault_env
from test_decode_graphs import Chain, same_steps
from test_inference import INFER, PROMPTS, mpiexec, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPU_CONFIG = ROOT / "config" / "gpu.yaml"
# the session's own run of config/gpu.yaml when benchmarks/gpu/run.sh gave none: fewer steps
GPU_QUICK = {"train": {"max_steps": 40, "eval_every": 20, "ckpt_every": 20}}
CUDA = {"device": "cuda", "backend": "nccl"}


def overlay(tmp: Path, name: str, cfg: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snakemake(workdir: Path, *args: str, extra: Path | None = None, **kw):
    """The user's command on config/gpu.yaml in `workdir`, with the session's own overlay (the
    `quick.yaml` beside a run this session made) and `extra` after it."""
    quick = workdir.parent / "quick.yaml"
    configs = [GPU_CONFIG, *([quick] if quick.is_file() else []), *([extra] if extra else [])]
    return run_snakemake(workdir, "--configfile", *map(str, configs), *args, configfile=None, **kw)


@pytest.fixture(scope="session")
def gpu_run(tmp_path_factory) -> Path:
    """A finished run of config/gpu.yaml: benchmarks/gpu/run.sh's (DISTLM_TESTS_GPU_WORKFLOW), or
    this session's with GPU_QUICK's fewer steps (its overlay beside it, as `quick.yaml`)."""
    given = os.environ.get("DISTLM_TESTS_GPU_WORKFLOW")
    if given:
        wd = Path(given)
        assert (wd / "results" / "report").is_dir(), f"{wd}: no finished run of config/gpu.yaml"
        return wd
    tmp = tmp_path_factory.mktemp("gpu")
    overlay(tmp, "quick", GPU_QUICK)
    wd = tmp / "work"
    wd.mkdir()
    snakemake(wd)
    return wd


def test_the_whole_workflow_finishes_on_one_gpu(gpu_run):
    """rule all on config/gpu.yaml: every stage's outputs, the report included, and a second
    run of the same command has nothing to do."""
    res = gpu_run / "results"
    for out in (
        "data/tokens.h5",
        "model/base/model.safetensors",
        "broadcast/report.json",
        "train/final/model.safetensors",
        "eval/base.json",
        "eval/trained.json",
        "inference/generations.jsonl",
        "report/summary.html",
    ):
        assert (res / out).is_file(), out
    again = snakemake(gpu_run, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_broadcast_on_the_gpu_says_what_it_measured(gpu_run):
    from distlm.documents import BroadcastReport, read_document

    rep = read_document(gpu_run / "results/broadcast/report.json", BroadcastReport)
    s = rep.stats
    assert s.device.startswith("cuda") and s.all_verified is True and s.bytes > 0
    if torch.cuda.device_count() == 1:  # one rank: the sender's move to the GPU
        assert rep.world_size == 1 and s.transport == "host-to-cuda" and s.receivers == []
    else:  # one rank per GPU, over NCCL
        assert s.backend == "nccl" and len(s.receivers) == torch.cuda.device_count() - 1
        assert all(r.verified for r in s.receivers)


def test_training_in_bf16_under_compile(gpu_run):
    from distlm.model import read_meta

    meta = read_meta(gpu_run / "results/train/final")
    assert meta.training["precision"] == "bf16" and meta.training["device"] == "cuda"
    assert meta.training["backend"] == "nccl"
    assert meta.training["world_size"] == torch.cuda.device_count()
    log = (gpu_run / "logs/train/rank0.log").read_text()
    assert "kernels standard" in log and "compile on" in log
    assert "(torch.compile included: " in log
    rows = (gpu_run / "results/train/metrics.csv").read_text().splitlines()
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    assert losses[-1] < losses[0]
    val = (gpu_run / "results/train/val.csv").read_text().splitlines()
    assert val[0].endswith(",seconds") and len(val) >= 3  # each validation's time, the first too


def test_evaluation_on_the_gpu(gpu_run):
    for model in ("base", "trained"):
        rep = json.loads((gpu_run / f"results/eval/{model}.json").read_text())
        assert rep["device"] == "cuda" and rep["precision"] == "bf16"
        assert rep["world_size"] == torch.cuda.device_count()
        for split in rep["splits"].values():
            assert split["tokens_scored"] > 0 and split["perplexity"] > 1
    base, trained = (
        json.loads((gpu_run / f"results/eval/{m}.json").read_text()) for m in ("base", "trained")
    )
    assert (
        trained["splits"]["validation"]["perplexity"] < base["splits"]["validation"]["perplexity"]
    )


def test_a_killed_training_resumes_on_the_gpu(gpu_run, tmp_path):
    """The user's kill: the training rank SIGKILLed after step 15 (checkpoints every 5, written
    in the background on a GPU: step 10's is on disk once step 15's save began, step 15's may
    not be); the same command again resumes from the newest that was written and finishes."""
    from distlm.model import read_meta

    wd = copy_workflow(gpu_run, tmp_path / "work")
    if (gpu_run.parent / "quick.yaml").is_file():
        shutil.copy(gpu_run.parent / "quick.yaml", tmp_path / "quick.yaml")
    edit = overlay(tmp_path, "edit", {"train": {"max_steps": 20, "ckpt_every": 5}})
    faults = fault_env(tmp_path / "faults.json", kill_after_step=15)
    started = time.time()
    first = snakemake(wd, "results/train/final", extra=edit, check=False, env=faults)
    # why, when the kill was not what ended it: Snakemake's output and the logs it wrote (the H200
    # run of 2026-11-26 saw this command fail in 3 s with rank0.log untouched)
    said = (first.stdout + first.stderr)[-4000:] + recent_logs(wd, since=started)
    assert first.returncode != 0, said
    assert "killing rank" in (wd / "logs/train/rank0.log").read_text(), said
    snakemake(wd, "results/train/final", extra=edit)
    log = (wd / "logs/train/rank0.log").read_text()
    assert "resuming from" in log
    # the resumed process compiled nothing: every graph came from the compile cache
    resumed = log[log.rindex("resuming from") :]
    assert "graph(s) from the compile cache, 0 compiled" in resumed, resumed[-3000:]
    meta = read_meta(wd / "results/train/final")
    assert meta.training["resumed_from"].endswith(("step-00000010", "step-00000015"))
    assert meta.training["steps"] == 20 and meta.training["device"] == "cuda"


@pytest.mark.parametrize("family,n_kv_head", [("gpt2", None), ("llama", 2)])
def test_the_compiled_training_step_attends_with_a_fused_kernel_on_the_gpu(family, n_kv_head):
    """The training loss module under torch.compile in bf16 on CUDA (the stage's fast kernels):
    its attention runs SDPA's flash (or cuDNN) kernel, never the memory-efficient or math one a
    materialised mask forces (tests/test_device.py traces the same graph on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from distlm.family import family_of
    from distlm.settings import init_settings
    from distlm.train.kernels import NextTokenLoss, attend_whole_blocks

    extra = {"n_kv_head": n_kv_head} if n_kv_head else {}
    init = init_settings(
        architecture=family, n_layer=2, n_head=4, n_embd=256, n_positions=512, **extra
    )
    fam = family_of(family)
    model = fam.build(fam.init_config(init, 1024, 0), seed=0).cuda().train()
    attend_whole_blocks(model)
    step = torch.compile(NextTokenLoss(model))
    ids = torch.randint(0, 1024, (4, 512), device="cuda")
    for _ in range(2):  # the compile, then a compiled step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(ids).backward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step(ids).backward()
        torch.cuda.synchronize()
    ops = {e.key for e in prof.key_averages() if "attention" in e.key}
    fused = {o for o in ops if "flash_attention" in o or "cudnn_attention" in o}
    slow = {
        o
        for o in ops
        if "efficient_attention" in o or o == "aten::_scaled_dot_product_attention_math"
    }
    assert fused and not slow, sorted(ops)


def test_checkpoint_copies_are_pinned_and_queued_on_the_stream():
    """On a GPU a background checkpoint's host copies are page-locked and queued on the device's
    stream (the loop does not wait for them); the event they end at says when the write may read,
    and then they hold the values of the save."""
    from distlm.train.checkpoint import CheckpointWriter

    writer = CheckpointWriter(background=True, pinned=True)
    w = torch.randn(1024, 1024, device="cuda")
    tree = {"w": w, "opt": {"state": {0: {"step": torch.tensor(3.0, device="cuda")}}}}
    before = w.clone()
    copy, ready = writer.stage(tree)
    assert ready is not None and copy["w"].is_pinned() and copy["w"].device.type == "cpu"
    w.add_(1)  # queued after the copy on the same stream
    ready.synchronize()
    assert torch.equal(copy["w"], before.cpu())
    assert copy["opt"]["state"][0]["step"].item() == 3.0
    writer.close()


@pytest.mark.parametrize("case", ["gpt2", "llama-kv1-tied"])
def test_decode_steps_replay_as_cuda_graphs_with_the_eager_steps_logits(pipeline_folders, case):
    """On a GPU the engine's decode steps are CUDA graphs, one per block of cache rows
    (distlm.inference.engine.pipeline_stage's `DecodeGraphs`): through tests/test_decode_graphs.py's
    schedule (lanes that come and go, a live lane outside the step, the cache grown and freed)
    the same logits as the eager steps on the same GPU, and the graphs were captured."""
    from distlm.device import DeviceBackend

    folder = pipeline_folders(case)[1]
    cuda = torch.device("cuda", 0)
    eager = Chain(folder, 1, DeviceBackend(cuda, decode_graphs=False))
    graphs = Chain(folder, 1, DeviceBackend(cuda))  # a GPU's default
    assert eager.models[0].graphs is None and graphs.models[0].graphs is not None
    same_steps(eager, graphs, tol=1e-4)
    assert graphs.models[0].graphs.captured >= 3


def test_a_failed_capture_leaves_the_decode_steps_eager(pipeline_folders, monkeypatch, caplog):
    """A decode step whose CUDA graph cannot be captured (out of memory, a kernel that refuses
    capture) is logged and the stage goes on with the eager steps: the same logits."""
    from distlm.device import DeviceBackend
    from distlm.inference.engine.pipeline_stage import Item, StaticStep

    def refuse(self):
        raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

    folder = pipeline_folders("gpt2")[1]
    cuda = torch.device("cuda", 0)
    eager = Chain(folder, 1, DeviceBackend(cuda, decode_graphs=False))
    graphs = Chain(folder, 1, DeviceBackend(cuda))
    monkeypatch.setattr(StaticStep, "capture", refuse)
    prompt = [Item(0, 0, 0, 5)]
    ids = torch.arange(5)
    tok = eager(prompt, ids).argmax(-1)
    assert torch.equal(graphs(prompt, ids).argmax(-1), tok)
    with caplog.at_level("WARNING"):
        got = graphs([Item(0, 0, 5, 1)], tok)
    torch.testing.assert_close(got, eager([Item(0, 0, 5, 1)], tok), atol=1e-4, rtol=1e-4)
    assert graphs.models[0].graphs is None
    assert "decode steps stay eager" in caplog.text and "the test's" in caplog.text


@pytest.fixture(scope="session")
def trained(gpu_run, tmp_path_factory) -> dict:
    """The trained folder, its pipeline folders of 1 and 2 stages, and `generate` on the GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distlm.model import write_pipeline_dir

    final = gpu_run / "results/train/final"
    root = tmp_path_factory.mktemp("gpu-pipelines")
    folders = {}
    for stages in (1, 2):
        folders[stages] = root / f"s{stages}"
        write_pipeline_dir(final, folders[stages], stages=stages)
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).cuda().eval()
    want = {}
    for p in PROMPTS:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]], device="cuda")
        out = model.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        want[p] = out[0, ids.shape[1] :].tolist()
    del model
    torch.cuda.empty_cache()
    return {"folders": folders, "want": want}


@pytest.mark.parametrize("stages", [1, 2])
def test_batch_inference_greedy_equals_generate_on_the_gpu(trained, tmp_path, stages):
    """The inference stage's entry point (one MPI rank per stage, the stages sharing the GPUs
    when there are fewer) against transformers' `generate` on the same GPU."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = write_config(
        tmp_path / "cfg.json",
        runtime=CUDA,
        stages=stages,
        lanes=4,
        max_new_tokens=12,
        temperature=0,
        top_k=0,
        timeout_s=120,
    )
    gen, timing = tmp_path / "generations.jsonl", tmp_path / "timing.json"
    proc = mpiexec(
        stages,
        INFER,
        *("--config", cfg, "--model", trained["folders"][stages], "--prompts", prompts),
        *("--generations", gen, "--timing", timing),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "kernels standard" in proc.stdout + proc.stderr
    recs = [json.loads(line) for line in gen.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == PROMPTS
    for r in recs:
        assert r["token_ids"] == trained["want"][r["prompt"]], r["prompt"]


def test_serving_a_real_request_on_the_gpu(trained, tmp_path):
    from openai import OpenAI
    from test_server import TOKEN, start_server, stop_server

    server = start_server(trained["folders"][1], 1, tmp_path, runtime=CUDA, lanes=4)
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key=TOKEN, max_retries=0)
        prompt = PROMPTS[0]
        out = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
        )
        assert out.choices[0].text and out.usage is not None
        assert out.usage.completion_tokens == len(trained["want"][prompt])
    finally:
        stop_server(server)
    assert "cuda" in server.log.read_text()


def test_a_config_asking_for_more_gpus_is_refused_before_any_work(tmp_path):
    """More training ranks than this machine has GPUs: refused before the first job, naming
    the key; nothing is written."""
    n = torch.cuda.device_count()
    edit = overlay(tmp_path, "edit", {"train": {"nproc_per_node": n + 1}})
    wd = tmp_path / "work"
    wd.mkdir()
    proc = snakemake(wd, extra=edit, check=False)
    assert proc.returncode != 0
    assert f"train.nproc_per_node: train needs {n + 1} ranks" in proc.stdout + proc.stderr
    assert not (wd / "results").exists()
    shutil.rmtree(wd)
