"""Every stage on a device, through the user's commands: the whole workflow (the broadcast and
the report included), training in the config's precision under torch.compile, a training killed
and resumed, evaluation, batch inference whose greedy output equals transformers' `generate` at
one and two stages, a real request to the server, and new weights pushed into it (a switch's
stall on the device).

Each test runs on the CPU (CI runs every line of them) and on CUDA (marker `gpu`; skipped
without a GPU): the same test functions, helpers and commands, parametrized over the device
(`device`). Only what needs CUDA is asserted on CUDA alone: the flash or cuDNN kernel's choice
on CUDA (the CPU's flash kernel on the CPU), graph capture, NCCL, pinned copies.

- cuda: config/gpu.yaml (GPT-2 small's shape, NCCL, bf16, torch.compile).
  `benchmarks/gpu/run.sh` runs these tests (`pytest -m gpu`) after its own run of the config,
  which it names in DISTLM_TESTS_GPU_WORKFLOW so that the tests read that run instead of making
  another; without it the session runs the config with fewer steps (GPU_QUICK) once.
- cpu: the tiny config with config/gpu.yaml's training settings that a CPU runs too (bf16,
  torch.compile): the session's tiny workflow run (`workflow_run`), copied, then the same
  command with that overlay, which reruns training and what follows it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, TINY, copy_workflow, recent_logs, run_snakemake
from harness.faults import fault_env
from test_decode_graphs import Chain, same_steps
from test_inference import INFER, PROMPTS, mpiexec, write_config

from distlm.runtime.device import DeviceBackend, kernels_for, resolve_precision

GPU_CONFIG = ROOT / "config" / "gpu.yaml"
# the session's own run of config/gpu.yaml when benchmarks/gpu/run.sh gave none: fewer steps
GPU_QUICK = {"train": {"max_steps": 40, "eval_every": 20, "ckpt_every": 20}}
# config/gpu.yaml's training settings that the tiny config runs on a CPU too
CPU_AS_GPU = {"train": {"precision": "bf16", "compile": True}, "eval": {"precision": "bf16"}}

pytestmark = pytest.mark.slow
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@dataclass(frozen=True)
class Run:
    """A finished run of the workflow on a device: its folder and the config files it ran."""

    device: str
    workdir: Path
    configs: tuple[Path, ...]

    @property
    def results(self) -> Path:
        return self.workdir / "results"

    def settings(self):
        """The settings the run was made with."""
        from distlm.dag.config import deep_merge, validate_settings

        merged: dict = {}
        for c in (ROOT / "config" / "config.yaml", *self.configs):
            merged = deep_merge(merged, yaml.safe_load(c.read_text()) or {})
        return validate_settings(merged)

    def ranks(self, stage: str) -> int:
        """The ranks the torch.distributed stage started (a null count: one per GPU)."""
        from distlm.settings.ranks import stage_ranks

        n = stage_ranks(self.settings(), stage).per_node
        return torch.cuda.device_count() if n == "gpu" else n


def overlay(tmp: Path, name: str, cfg: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snakemake(run: Run, *args: str, workdir: Path | None = None, extra: Path | None = None, **kw):
    """The user's command on the run's config files (and `extra` after them) in `workdir`
    (default: the run's): `args` are targets, then options."""
    configs = (*run.configs, *([extra] if extra else []))
    return run_snakemake(workdir or run.workdir, *args, configfiles=configs, **kw)


@pytest.fixture(scope="module")
def gpu_run(device, workflow_run, tmp_path_factory) -> Run:
    """A finished run of the device's config: on CUDA benchmarks/gpu/run.sh's
    (DISTLM_TESTS_GPU_WORKFLOW), or this session's with GPU_QUICK's fewer steps (its overlay
    beside it); on the CPU the tiny workflow's run with CPU_AS_GPU (training and what follows it
    run again)."""
    tmp = tmp_path_factory.mktemp(f"run-{device}")
    if device == "cpu":
        run = Run("cpu", copy_workflow(workflow_run, tmp / "work"), (TINY,))
        run = Run("cpu", run.workdir, (TINY, overlay(tmp, "as-gpu", CPU_AS_GPU)))
        snakemake(run)
        return run
    given = os.environ.get("DISTLM_TESTS_GPU_WORKFLOW")
    if given:
        wd = Path(given)
        assert (wd / "results" / "report").is_dir(), f"{wd}: no finished run of config/gpu.yaml"
        return Run("cuda", wd, (GPU_CONFIG,))
    run = Run("cuda", tmp / "work", (GPU_CONFIG, overlay(tmp, "quick", GPU_QUICK)))
    run.workdir.mkdir()
    snakemake(run)
    return run


def test_the_whole_workflow_finishes_on_the_device(gpu_run):
    """rule all: every stage's outputs, the report included, and a second run of the same
    command has nothing to do."""
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
        assert (gpu_run.results / out).is_file(), out
    again = snakemake(gpu_run, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_broadcast_on_the_device_says_what_it_measured(gpu_run):
    from distlm.broadcast.documents import BroadcastReport
    from distlm.core.documents import read_document

    rep = read_document(gpu_run.results / "broadcast/report.json", BroadcastReport)
    s = rep.stats
    assert s.device.startswith(gpu_run.device) and s.all_verified is True and s.bytes > 0
    assert rep.world_size == gpu_run.ranks("broadcast")
    if rep.world_size == 1:  # one GPU: the sender's move to it, no receiver
        assert s.transport == "host-to-cuda" and s.receivers == []
    else:  # one rank a GPU over NCCL, or the CPU's ranks over gloo
        assert s.backend == gpu_run.settings().runtime.backend
        assert len(s.receivers) == rep.world_size - 1
        assert all(r.verified for r in s.receivers)


def test_training_in_the_configs_precision_under_compile(gpu_run):
    from distlm.model import read_meta

    s = gpu_run.settings()
    dev = torch.device(gpu_run.device)
    meta = read_meta(gpu_run.results / "train/final")
    precision = resolve_precision(s.train.precision, dev, key="train.precision")
    assert (precision, s.train.compile) == ("bf16", True)  # both devices' runs ask for them
    assert meta.training["precision"] == precision and meta.training["device"] == dev.type
    assert meta.training["backend"] == s.runtime.backend
    assert meta.training["world_size"] == gpu_run.ranks("train")
    log = (gpu_run.workdir / "logs/train/rank0.log").read_text()
    assert f"kernels {kernels_for(dev)}" in log and "compile on" in log
    assert "(torch.compile included: " in log
    rows = (gpu_run.results / "train/metrics.csv").read_text().splitlines()
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    assert losses[-1] < losses[0]
    val = (gpu_run.results / "train/val.csv").read_text().splitlines()
    assert val[0].endswith(",seconds") and len(val) >= 3  # each validation's time, the first too


def test_evaluation_on_the_device(gpu_run):
    s = gpu_run.settings()
    precision = resolve_precision(s.eval.precision, torch.device(gpu_run.device), key="eval")
    reports = {
        m: json.loads((gpu_run.results / f"eval/{m}.json").read_text()) for m in ("base", "trained")
    }
    for rep in reports.values():
        assert rep["device"] == gpu_run.device and rep["precision"] == precision
        assert rep["world_size"] == gpu_run.ranks("eval")
        for split in rep["splits"].values():
            assert split["tokens_scored"] > 0 and split["perplexity"] > 1
    trained, base = (reports[m]["splits"]["validation"]["perplexity"] for m in ("trained", "base"))
    assert trained < base


def test_a_killed_training_resumes_on_the_device(gpu_run, tmp_path):
    """The user's kill: the training rank SIGKILLed after step 15 (checkpoints every 5, written
    in the background on a GPU: step 10's is on disk once step 15's save began, step 15's may
    not be); the same command again resumes from the newest that was written and finishes, and
    the resumed process compiles nothing (every graph from the compile cache the first left)."""
    from distlm.model import read_meta

    wd = copy_workflow(gpu_run.workdir, tmp_path / "work")
    edit = overlay(tmp_path, "edit", {"train": {"max_steps": 20, "ckpt_every": 5}})
    faults = fault_env(tmp_path / "faults.json", kill_after_step=15)
    started = time.time()
    first = snakemake(
        gpu_run, "results/train/final", workdir=wd, extra=edit, check=False, env=faults
    )
    # why, when the kill was not what ended it: Snakemake's output and the logs it wrote
    said = (first.stdout + first.stderr)[-4000:] + recent_logs(wd, since=started)
    assert first.returncode != 0, said
    killed = "\n".join(p.read_text() for p in (wd / "logs/train").glob("rank*.log"))
    assert "killing rank" in killed, said
    snakemake(gpu_run, "results/train/final", workdir=wd, extra=edit)
    log = (wd / "logs/train/rank0.log").read_text()
    assert "resuming from" in log
    resumed = log[log.rindex("resuming from") :]
    assert "graph(s) from the compile cache, 0 compiled" in resumed, resumed[-3000:]
    meta = read_meta(wd / "results/train/final")
    assert meta.training["resumed_from"].endswith(("step-00000010", "step-00000015"))
    assert meta.training["steps"] == 20 and meta.training["device"] == gpu_run.device


@pytest.mark.parametrize("family,n_kv_head", [("gpt2", None), ("llama", 2)])
def test_the_compiled_training_step_attends_with_a_fused_kernel(device, family, n_kv_head):
    """The training loss under torch.compile in bf16 (what the stage runs): its attention runs
    SDPA's flash kernel (or cuDNN's, on CUDA), never the memory-efficient or math one a
    materialised mask forces; on the CPU its flash kernel for the CPU."""
    from torch.profiler import ProfilerActivity, profile

    from distlm.family import family_of
    from distlm.model import init_config, init_model
    from distlm.settings import init_settings
    from distlm.train.kernels import NextTokenLoss

    dev = torch.device(device)
    extra = {"n_kv_head": n_kv_head} if n_kv_head else {}
    init = init_settings(
        architecture=family, n_layer=2, n_head=4, n_embd=256, n_positions=512, **extra
    )
    config = init_config(init, 1024, 0)
    fam = family_of(config)
    model = fam.build(fam.args(config.to_dict(), family), device=dev)
    model.load_hf(dict(init_model(config, seed=0).named_parameters()), family)
    step = torch.compile(NextTokenLoss(model.train()))
    ids = torch.randint(0, 1024, (4, 512) if device == "cuda" else (2, 64), device=dev)
    hw = DeviceBackend(dev, "bf16")
    for _ in range(2):  # the compile, then a compiled step
        with hw.autocast():
            step(ids).backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        with hw.autocast():
            step(ids).backward()
        hw.synchronize()
    ops = {e.key for e in prof.key_averages() if "attention" in e.key}
    fused = {o for o in ops if "flash_attention" in o or "cudnn_attention" in o}
    slow = {
        o
        for o in ops
        if "efficient_attention" in o or o == "aten::_scaled_dot_product_attention_math"
    }
    assert fused and not slow, sorted(ops)
    torch._dynamo.reset()


def test_background_checkpoint_copies_hold_the_saves_values(device):
    """A background checkpoint's host copies hold the values of the save, whatever the loop
    then does to the originals; on a GPU they are page-locked and queued on the device's stream
    (the loop does not wait for them), and the event they end at says when the write may read."""
    from distlm.train.checkpoint_writer import CheckpointWriter

    pinned = device == "cuda"
    writer = CheckpointWriter(background=True, pinned=pinned)
    w = torch.randn(1024, 1024, device=device)
    tree = {"w": w, "opt": {"state": {0: {"step": torch.tensor(3.0, device=device)}}}}
    before = w.clone()
    copy, ready = writer.stage(tree)
    assert copy["w"].device.type == "cpu"
    if pinned:
        assert ready is not None and copy["w"].is_pinned()
    w.add_(1)  # on a GPU, queued after the copy on the same stream
    if ready is not None:
        ready.synchronize()
    assert torch.equal(copy["w"], before.cpu())
    assert copy["opt"]["state"][0]["step"].item() == 3.0
    writer.close()


def backends(device: str) -> tuple[DeviceBackend, DeviceBackend]:
    """(the engine's eager decode steps, its static ones: captured as CUDA graphs on a GPU)."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    return DeviceBackend(dev, decode_graphs=False), DeviceBackend(dev, decode_graphs=True)


@pytest.mark.parametrize("case", ["gpt2", "llama-kv1-tied"])
def test_decode_steps_as_static_steps_give_the_eager_steps_logits(pipeline_folders, device, case):
    """The engine's decode steps as static steps, one per block of cache rows
    (distlm.inference.engine.graphs' `DecodeGraphs`), through tests/test_decode_graphs.py's
    schedule (lanes that come and go, a live lane outside the step, the cache grown and freed):
    the same logits as the eager steps on the same device; on a GPU they were captured as CUDA
    graphs."""
    folder = pipeline_folders(case)[1]
    eager_hw, static_hw = backends(device)
    eager, graphs = Chain(folder, 1, eager_hw), Chain(folder, 1, static_hw)
    assert eager.models[0].graphs is None and graphs.models[0].graphs is not None
    same_steps(eager, graphs, tol=1e-4)
    if static_hw.capture_graphs:
        assert graphs.models[0].graphs.captured >= 3


def test_a_failed_capture_leaves_the_decode_steps_eager(
    pipeline_folders, device, monkeypatch, caplog
):
    """A decode step whose CUDA graph cannot be captured (out of memory, a kernel that refuses
    capture) is logged and the stage goes on with the eager steps: the same logits. On the CPU
    the static steps ask for a capture as a GPU's do, and it fails the same way."""
    from dataclasses import replace

    from distlm.inference.engine.graphs import StaticStep
    from distlm.inference.engine.micro_batch import Item

    def refuse(self):
        raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

    folder = pipeline_folders("gpt2")[1]
    eager_hw, static_hw = backends(device)
    eager = Chain(folder, 1, eager_hw)
    graphs = Chain(folder, 1, replace(static_hw, capture_graphs=True))
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


@pytest.fixture(scope="module")
def trained(gpu_run, tmp_path_factory) -> dict:
    """The trained folder, its pipeline folders of 1 and 2 stages, and transformers' `generate`
    of it on the device."""
    from distlm.model import write_pipeline_dir

    final = gpu_run.results / "train/final"
    root = tmp_path_factory.mktemp(f"pipelines-{gpu_run.device}")
    folders = {}
    for stages in (1, 2):
        folders[stages] = root / f"s{stages}"
        write_pipeline_dir(final, folders[stages], stages=stages)
    want = generate_ids(final, gpu_run.device)
    return {"folders": folders, "want": want, "runtime": runtime_of(gpu_run.device), "final": final}


def generate_ids(folder: Path, device: str, n: int = 12) -> dict[str, list[int]]:
    """transformers' greedy `generate` of each prompt on a model folder, on `device`: the new
    tokens' ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType] (its .to)
    want = {}
    for p in PROMPTS:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]], device=device)
        out = model.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        want[p] = out[0, ids.shape[1] :].tolist()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return want


def runtime_of(device: str) -> dict:
    return {"device": device, "backend": "nccl" if device == "cuda" else "gloo"}


@pytest.mark.parametrize("stages", [1, 2])
def test_batch_inference_greedy_equals_generate(trained, tmp_path, stages):
    """The inference stage's entry point (one MPI rank per stage, the stages sharing the GPUs
    when there are fewer) against transformers' `generate` on the same device."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = write_config(
        tmp_path / "cfg.json",
        runtime=trained["runtime"],
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
    device = trained["runtime"]["device"]
    assert f"kernels {kernels_for(torch.device(device))}" in proc.stdout + proc.stderr
    recs = [json.loads(line) for line in gen.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == PROMPTS
    for r in recs:
        assert r["token_ids"] == trained["want"][r["prompt"]], r["prompt"]


def test_serving_a_real_request(trained, tmp_path):
    from openai import OpenAI
    from test_server import TOKEN, start_server, stop_server

    server = start_server(trained["folders"][1], 1, tmp_path, runtime=trained["runtime"], lanes=4)
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
    assert trained["runtime"]["device"] in server.log.read_text()


def test_a_push_into_a_server_on_the_device(trained, tmp_path):
    """New weights pushed into a running one-stage server on the device (POST
    /update_weights_from_distributed; distlm.transfer.push), as a training rank pushes them: the
    trained weights nudged, taken from the device to host memory, each tensor sent to the stage,
    staged on its device and switched in. The server then names the pushed weights' digest,
    reports the switch's stall (issue #65's GPU goal bounds it: the copy in, synchronised) and
    answers transformers' greedy `generate` on those weights, on the same device."""
    import threading

    from test_server import start_server, stop_server
    from transformers import AutoTokenizer

    from distlm.inference.messages import fingerprint
    from distlm.model import load_safetensors, read_args, read_meta, write_model_dir
    from distlm.model.folder import safetensors_sha256
    from distlm.settings import TransferSettings
    from distlm.transfer.documents import PUSH_ROUTE
    from distlm.transfer.push import PushSender

    device, final = trained["runtime"]["device"], trained["final"]
    on_device = {k: v.to(device) for k, v in load_safetensors(final / "model.safetensors").items()}
    nudged = {  # as a training step leaves them: every float tensor changed
        k: (v * 1.001 if v.is_floating_point() else v).to("cpu") for k, v in on_device.items()
    }
    keep = ("created_by", "source", "config_digest", "data_config_digest", "dtype")
    meta = read_meta(final).model_dump()
    folder = tmp_path / "nudged"
    write_model_dir(
        folder,
        state_dict=nudged,
        config_from=final,
        tokenizer_dir=final.parents[1] / "data" / "tokenizer",  # results/data/tokenizer
        meta={k: meta[k] for k in keep},
    )
    want = generate_ids(folder, device)
    digest = safetensors_sha256(nudged)
    assert digest == read_meta(folder).model_sha256  # what the push names them by

    server = start_server(trained["folders"][1], 1, tmp_path, runtime=trained["runtime"], lanes=4)
    try:
        settings = TransferSettings(transport="torch", bucket_mb=64, chunk_mb=4, timeout_s=120)
        # on the device as a training rank is: one GPU, so its route is through host memory
        sender = PushSender.open(host="127.0.0.1", settings=settings, device=torch.device(device))
        offer = sender.offer(digest, "test push", read_args(final).signature())
        reply: dict = {}
        answered = threading.Event()

        def post() -> None:
            body = {**offer.model_dump(mode="json"), "policy": "wait"}
            reply["answer"] = server.request("POST", PUSH_ROUTE, body, timeout=300)
            answered.set()

        t = threading.Thread(target=post)
        t.start()
        sent = sender.send(offer, nudged, done=answered.is_set)
        t.join(300)
        status, b = reply["answer"]
        assert status == 200 and b["changed"] and b["weights"] == digest, b
        assert sent is not None and sent[0].stats.all_verified  # every chunk's checksum held
        print(
            f"{device}: pushed {b['bytes'] / 1e6:.0f} MB in {b['seconds']:.3f} s, stall {b['stall']}"
        )
        assert 0 < b["stall"]["switch_s"] < b["seconds"], b
        tok = AutoTokenizer.from_pretrained(final)
        for prompt, ids in want.items():
            status, out = server.request(
                "POST",
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 12, "temperature": 0},
            )
            assert status == 200 and out["system_fingerprint"] == fingerprint(digest), out
            assert out["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True), prompt
    finally:
        stop_server(server)


def test_a_config_the_machine_cannot_run_is_refused_before_any_work(device, tmp_path):
    """More training ranks than this machine has GPUs (on a machine without one: a CUDA config
    at all) is refused before the first job, naming the key; nothing is written."""
    n = torch.cuda.device_count() if device == "cuda" else 0
    if n:
        edit = {"train": {"nproc_per_node": n + 1}}
        said = f"train.nproc_per_node: train needs {n + 1} ranks"
    else:  # config/gpu.yaml itself (runtime.device: cuda)
        edit, said = {}, "runtime.device: cuda, but this machine has no GPU"
    run = Run(device, tmp_path / "work", (GPU_CONFIG, overlay(tmp_path, "edit", edit)))
    run.workdir.mkdir()
    proc = snakemake(run, check=False)
    assert proc.returncode != 0
    assert said in proc.stdout + proc.stderr
    assert not (run.results).exists()
    shutil.rmtree(run.workdir)
