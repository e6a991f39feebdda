"""The device backend (distlm.runtime.device), the machine's GPUs (distlm.runtime.machine) and the stages' rank
counts (distlm.settings.ranks), on the CPU: what the backend decides, what it refuses (naming the
key), and the numerics of the GPU's kernel set run here at small shapes.

The GPU's own runs are tests/test_gpu.py (marker `gpu`, skipped without CUDA). Here the kernel set
"standard" runs on the CPU against the CPU-tuned one and transformers', and a dispatch mode finds
a tensor made on the CPU that meets data on another device: on a CPU-only machine the model runs
on the `meta` device, where such a tensor is as foreign as on a GPU (the H100 run's crash was a
0-dim CPU constant that met CUDA tensors in the engine's GELU).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlm import DistlmError
from distlm.dag.config import load_config
from distlm.runtime import machine as machine_module
from distlm.runtime.device import (
    DeviceBackend,
    check_ranks_fit,
    kernels_for,
    resolve_precision,
)
from distlm.runtime.dist import MPI_RING, Topology
from distlm.runtime.host import threads_per_rank
from distlm.runtime.machine import physical_gpus, ranks_problem, visible_count, visible_gpus
from distlm.settings.ranks import GPU, StageRanks, machine_problems, stage_ranks
from distlm.settings.validate import validate

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- decisions


def test_precision_is_the_devices_and_never_falls_back():
    assert resolve_precision("auto", CPU, key="train.precision") == "fp32"
    assert resolve_precision("bf16", CPU, key="train.precision") == "bf16"
    with pytest.raises(DistlmError, match=r"^eval.precision: fp16 needs a GPU"):
        resolve_precision("fp16", CPU, key="eval.precision")
    with pytest.raises(DistlmError, match=r"^train.precision: unknown precision 'fp8'"):
        resolve_precision("fp8", CPU, key="train.precision")


def test_the_cpu_backend():
    hw = DeviceBackend.for_rank("cpu", precision="bf16", precision_key="train.precision")
    assert hw.device == CPU and hw.kernels == "cpu" and hw.autocast_dtype is torch.bfloat16
    assert hw.ddp_device_ids is None and not hw.is_gpu
    m = torch.nn.Linear(2, 2)
    assert hw.compiled(m) is m  # compile off
    assert DeviceBackend(CPU, compile=True).compiled(m) is not m
    x = torch.ones(3)
    assert hw.to_device(x) is x
    with hw.autocast():
        assert torch.is_autocast_enabled("cpu")
    with DeviceBackend.cpu().autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert kernels_for(torch.device("cuda", 0)) == "standard" and kernels_for(CPU) == "cpu"
    # tests run the GPU's kernel set on the CPU by giving it
    assert DeviceBackend(CPU, kernels="standard").kernels == "standard"


@pytest.mark.parametrize(
    "inherited",
    [
        {},  # nothing set: the stage's folder
        # inductor's defaults, which a process that compiled writes into its environment and a
        # process it starts inherits: inductor's folder, and Triton's under it once it built one
        {"TORCHINDUCTOR_CACHE_DIR": "{default}", "TRITON_CACHE_DIR": "{default}/triton/0"},
    ],
)
def test_compile_caches_live_with_the_stage_unless_the_user_set_them(
    inherited, tmp_path, monkeypatch
):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
        if var in inherited:
            monkeypatch.setenv(var, inherited[var].format(default=default))
    DeviceBackend(CPU, compile=True).keep_compile_cache(tmp_path / "stage")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "stage" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "stage" / "triton")
    # the user's own cache stays theirs
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine-triton"))
    DeviceBackend(CPU, compile=True).keep_compile_cache(tmp_path / "stage")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine-triton")


def test_rng_state_round_trips():
    hw = DeviceBackend.cpu()
    state = hw.rng_state()
    a = torch.rand(3)
    hw.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    with pytest.raises(DistlmError, match="no CUDA RNG state"):
        DeviceBackend(torch.device("cuda", 0), kernels="standard").set_rng_state(state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_cuda_on_a_machine_without_a_gpu_is_refused_naming_the_key():
    with pytest.raises(DistlmError, match=r"^runtime.device: cuda, but this node .* has no GPU"):
        DeviceBackend.for_rank("cuda", ranks_key="train.nproc_per_node")


def test_more_ranks_than_gpus_is_refused_naming_the_key():
    check_ranks_fit(2, 2, ranks_key="train.nproc_per_node", where="n")
    with pytest.raises(
        DistlmError, match=r"^train.nproc_per_node: 4 ranks on n, which has 1 GPU\(s\)"
    ):
        check_ranks_fit(4, 1, ranks_key="train.nproc_per_node", where="n")
    with pytest.raises(DistlmError, match=r"^runtime.device: cuda, but n has no GPU"):
        check_ranks_fit(1, 0, ranks_key="eval.nproc_per_node", where="n")


def test_the_ranks_fit_the_gpus_by_one_rule(monkeypatch):
    """The workflow before any job, the SLURM launcher on each node and every rank ask one rule
    (distlm.runtime.machine.ranks_problem): the same case gets the same words at each."""
    from distlm.launch.srun import gpus_here

    key = "train.nproc_per_node"
    problem = ranks_problem(4, 1, key=key, where="this machine")
    assert problem and problem.startswith(f"{key}: 4 ranks on this machine, which has 1 GPU(s)")
    assert StageRanks("train", key, 4, on_gpu=True).fits(1) == problem.replace(
        "ranks on", "ranks of stage train on"
    )
    with pytest.raises(DistlmError) as refused:
        check_ranks_fit(4, 1, ranks_key=key, where="this machine")
    assert str(refused.value) == problem
    assert ranks_problem(2, 2, key=key, where="n") is None
    null = ranks_problem(None, 0, key=key, where="this machine")
    assert StageRanks("train", key, GPU, on_gpu=True).fits(0) == null
    monkeypatch.setattr(machine_module, "physical_gpus", lambda: 0)
    with pytest.raises(
        DistlmError,
        match=r"^train.nproc_per_node, eval.nproc_per_node or broadcast.receivers: null means "
        r"one rank per GPU, and node n7 has none that CUDA can see \(CUDA_VISIBLE_DEVICES=unset\); "
        r"set .*, or runtime.device: cpu, or give the rule GPUs \(gres\)$",
    ):
        gpus_here({"SLURMD_NODENAME": "n7"})


def test_a_rank_takes_its_share_of_its_launchers_thread_budget(monkeypatch):
    """One rule for both launchers: under torchrun OMP_NUM_THREADS is a ceiling a rank, under
    mpiexec (the pipeline, `job_budget`) the job's total, shared by the ranks on the host."""
    assert threads_per_rank({"OMP_NUM_THREADS": "4"}, 16, local_ranks=2) == 4
    assert threads_per_rank({"OMP_NUM_THREADS": "4"}, 16, local_ranks=2, job_budget=True) == 2
    assert threads_per_rank({}, 16, local_ranks=2, job_budget=True) == 8
    assert threads_per_rank({"OMP_NUM_THREADS": "3"}, 16, local_ranks=2, job_budget=True) == 1
    assert threads_per_rank({"OMP_NUM_THREADS": "1"}, 16, local_ranks=2, job_budget=True) == 1
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        stage = Topology(1, 3, 1, MPI_RING, DeviceBackend.cpu(), local_world_size=2)
        assert stage.share_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_serve_jobs_threads_count_its_api_servers_and_its_tasks_the_ranks(tmp_path):
    """The user's dry run of `serve` with either profile: the job's threads are its processes
    (the ranks, which share them all, and the API server processes beside stage 0); under SLURM
    its tasks are the ranks alone (srun -n S)."""
    from conftest import ROOT, TINY, run_snakemake

    two = tmp_path / "serve.yaml"
    two.write_text("serve:\n  stages: 2\n  api_servers: 3\n")
    proc = run_snakemake(tmp_path, "serve", "-n", "--cores", "8", configfiles=(TINY, two))
    job = proc.stdout[proc.stdout.index("rule serve:") :]
    assert re.search(r"^\s+threads: 5$", job, re.MULTILINE), job
    assert re.search(r"resources: .*\btasks=2\b", job), job
    proc = run_snakemake(
        tmp_path, "serve", "-n", configfiles=(TINY, two), profile=ROOT / "profiles" / "slurm"
    )
    job = proc.stdout[proc.stdout.index("rule serve:") :]
    assert re.search(r"resources: .*\btasks=2\b.*\bmpi=srun --mpi=pmi2\b", job), job
    assert "--launcher 'srun --mpi=pmi2 -n 2'" in job, job


def test_one_topology_for_the_process_group_and_the_pipelines_ring():
    last = Topology(2, 3, 0, MPI_RING, DeviceBackend.cpu())
    assert (last.next, last.prev, last.is_last, last.is_main) == (0, 1, True, False)
    first = Topology(0, 3, 0, MPI_RING, DeviceBackend.cpu())
    assert (first.next, first.prev, first.is_last, first.is_main) == (1, 2, False, True)
    alone = Topology.single()
    assert (alone.next, alone.prev, alone.is_last, alone.is_distributed) == (0, 0, True, False)
    assert alone.device == CPU and alone.backend == "gloo"


# ----------------------------------------------------------------------------- the machine


def test_cuda_visible_devices_is_read_as_cuda_reads_it():
    assert visible_count(4, {}) == 4
    assert visible_count(4, {"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert visible_count(4, {"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_count(4, {"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1  # stops at -1
    assert visible_count(1, {"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 1  # never beyond the physical


def test_physical_gpus_from_the_drivers_folder(tmp_path, monkeypatch):
    from distlm.runtime import machine

    (tmp_path / "0000:17:00.0").mkdir()
    (tmp_path / "0000:65:00.0").mkdir()
    monkeypatch.setattr(machine, "NVIDIA_PROC", tmp_path)
    assert physical_gpus() == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == 1
    monkeypatch.setattr(machine, "NVIDIA_PROC", tmp_path / "none")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    assert physical_gpus() == 0


# ----------------------------------------------------------------------------- rank counts


def settings(**overlay):
    return validate(load_config("config/config.yaml", overlay), source="test")[1]


def test_a_null_count_follows_the_machine():
    cpu = settings(
        train={"nproc_per_node": None}, eval={"nproc_per_node": None}, broadcast={"receivers": None}
    )
    assert [stage_ranks(cpu, s).per_node for s in ("train", "eval", "broadcast")] == [1, 1, 1]
    gpu = settings(
        runtime={"device": "cuda", "backend": "nccl"},
        train={"nproc_per_node": None},
        broadcast={"receivers": None},
    )
    assert stage_ranks(gpu, "train").per_node == GPU == stage_ranks(gpu, "broadcast").per_node
    assert stage_ranks(gpu, "eval").per_node == 2  # config.yaml's
    assert stage_ranks(gpu, "train").threads(gpus=4) == 4
    assert stage_ranks(gpu, "train").threads(gpus=0) == 1  # a dry run without a GPU
    assert stage_ranks(settings(broadcast={"receivers": 0}), "broadcast").per_node == 1


def machine(gpus: int, gpu_gib: float = 80, host_gib: float = 64):
    """A machine of `gpus` GPUs of `gpu_gib` each and `host_gib` of memory."""
    from distlm.runtime.machine import Machine

    return Machine(gpus, int(gpu_gib * 2**30) if gpus else None, int(host_gib * 2**30))


def test_a_config_the_machine_cannot_run_names_the_key():
    gpu = settings(runtime={"device": "cuda", "backend": "nccl"})  # 2 ranks, 2 receivers
    assert machine_problems(gpu, machine(0)) == [
        (
            "runtime.device: cuda, but this machine has no GPU that CUDA can see; set "
            "runtime.device: cpu (or auto), or run on a GPU machine"
        )
    ]
    problems = machine_problems(gpu, machine(1))
    assert [p.split(":")[0] for p in problems] == [
        "broadcast.receivers",
        "train.nproc_per_node",
        "eval.nproc_per_node",
    ]  # inference.stages: the pipeline's stages share GPUs (they talk over MPI)
    assert (
        "3 ranks of stage broadcast on this machine" in problems[0]
        and "has 1 GPU(s)" in problems[0]
    )
    assert machine_problems(gpu, machine(4)) == []
    assert machine_problems(settings(), machine(0)) == []  # the CPU default
    auto = settings(runtime={"device": "auto"}, train={"nproc_per_node": None})
    assert machine_problems(auto, machine(0)) == [
        (
            "train.nproc_per_node: null means one rank per GPU, and this machine has none that "
            "CUDA can see; set train.nproc_per_node, or runtime.device: cpu"
        )
    ]


def test_a_model_whose_state_does_not_fit_under_ddp_is_refused_naming_fsdp():
    """config/llama-1b-fsdp.yaml's model: 16 bytes a parameter (~14.8 GiB) on every rank under
    ddp does not fit 12 GiB GPUs; sharded over 4 ranks it does (3.7 GiB of model state and the
    weights a rank gathers whole for the compute: 4.3 GiB), so the refusal names
    train.parallel: fsdp; under fsdp over 4 it runs; on 1 nothing fits: the refusal says more
    ranks."""
    from distlm.dag.config import load_settings

    s = load_settings("config/llama-1b-fsdp.yaml")
    assert s.train.parallel == "fsdp"
    ddp = settings(**{**_overlay(s), "train": {**_overlay(s)["train"], "parallel": "ddp"}})
    [problem] = machine_problems(ddp, machine(4, gpu_gib=12))
    assert problem.startswith("train.parallel: ddp: 0.99 B parameters need 16 bytes each")
    assert "set train.parallel: fsdp, sharded over the 4 ranks (4.3 GiB a rank)" in problem
    assert machine_problems(s, machine(4, gpu_gib=12)) == []
    one = settings(**{**_overlay(s), "train": {**_overlay(s)["train"], "nproc_per_node": 1}})
    [problem] = machine_problems(one, machine(1, gpu_gib=12))
    assert "more ranks (train.nproc_per_node, train.nodes)" in problem
    assert machine_problems(ddp, machine(4, gpu_gib=80)) == []  # an 80 GB GPU holds it whole


def _overlay(s) -> dict:
    """A config file's settings as an overlay (for `settings`)."""
    return {k: v for k, v in s.model_dump().items() if k != "sweep"}


def test_the_gpu_config_fits_one_gpu():
    from distlm.dag.config import load_settings

    s = load_settings("config/gpu.yaml")
    assert machine_problems(s, machine(1)) == []
    assert {st: stage_ranks(s, st).per_node for st in ("broadcast", "train", "eval")} == {
        "broadcast": GPU,
        "train": GPU,
        "eval": GPU,
    }
    assert (s.runtime.device, s.runtime.backend, s.train.precision, s.train.compile) == (
        "cuda",
        "nccl",
        "bf16",
        True,
    )
    assert (s.model.source, s.data.source) == ("init", "embedded")  # offline


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["gpu.yaml", "gpt2-wikitext2.yaml", "smollm2-135m.yaml", "qwen3-0.6b.yaml"]
)
def test_a_dry_run_without_a_gpu_plans_the_gpu_configs(name, tmp_path):
    """The user's dry run of a GPU config on a machine with no GPU visible (a SLURM cluster's
    login node): every stage is planned; the ranks per GPU are counted where the ranks run."""
    from conftest import ROOT, run_snakemake

    proc = run_snakemake(
        tmp_path, "-n", configfile=ROOT / "config" / name, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    stats = proc.stdout[proc.stdout.index("Job stats:") :]
    for rule in ("broadcast", "train", "evaluate", "inference", "report"):
        assert re.search(rf"^{rule}\s+\d+$", stats, re.MULTILINE), (rule, stats)


# ----------------------------------------------------------------------------- kernels


class DeviceMix(TorchDispatchMode):
    """Records every operation that meets tensors of two devices (a CPU tensor made without the
    device of the data it meets); run the model on `meta` to find them on a CPU-only machine."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        devices = set()

        def visit(a):
            if isinstance(a, torch.Tensor):
                devices.add(a.device.type)
            elif isinstance(a, list | tuple):
                for b in a:
                    visit(b)

        visit(args)
        visit(list((kwargs or {}).values()))
        if len(devices) > 1:
            self.mixed.append(f"{func}: {sorted(devices)}")
        return func(*args, **(kwargs or {}))


def tiny_model(family: str, *, n_kv_head: int | None = None, device="cpu"):
    """distlm's model of a tiny seeded init of `family` (2 blocks of 16), and transformers' model
    of the same weights (its reference)."""
    from distlm.model import family_of, init_config, init_model
    from distlm.settings import init_settings

    extra = {"n_kv_head": n_kv_head} if n_kv_head else {}
    init = init_settings(
        architecture=family, n_layer=2, n_head=2, n_embd=16, n_positions=32, dropout=0.0, **extra
    )
    config = init_config(init, 64, 0)
    hf = init_model(config, seed=0)
    with torch.no_grad():  # transformers' init leaves biases at 0 and norms at 1: draw them too
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    fam = family_of(config)
    args = fam.args(config.to_dict(), family)
    model = fam.build(args, device=device)
    model.load_hf({k: v.to(device) for k, v in hf.named_parameters()}, family)
    return model, hf


def test_gpt2s_gelu_is_transformers_to_float_rounding():
    """GPT-2's gelu_new (NewGELUActivation, eight operations) is torch's tanh GELU in distlm's
    blocks (one standard kernel): the same function to float rounding."""
    from transformers.activations import NewGELUActivation

    model, _ = tiny_model("gpt2")
    x = torch.linspace(-6, 6, 4001, dtype=torch.float64)
    got = model.blocks[0].mlp.act(x.float())
    assert (got.double() - NewGELUActivation()(x)).abs().max() < 2e-6


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_the_model_makes_no_tensor_on_another_device(family):
    """distlm's model with weights and inputs on `meta`, as training runs it and as a pipeline
    stage does (embed, positions, qkv, finish, head): no operation meets a CPU tensor."""
    model, _ = tiny_model(family)
    model = model.to("meta")
    ids = torch.arange(5, device="meta")
    with DeviceMix() as mix:
        model(ids[None])  # (1, 5): training's and evaluation's forward
        x = model.embed(ids, ids)  # (5, C): a pipeline stage's packed tokens
        rot = model.positions(ids, x.dtype)
        q, _kv = model.blocks[0].qkv(x, rot)
        x = model.blocks[0].finish(x, q.reshape(5, -1))
        model.head(x)
    assert mix.mixed == []


def test_device_mix_finds_a_cpu_constant():
    """The check can fail: the engine's GELU as it was (a 0-dim CPU constant)."""
    k = torch.tensor(2.0)
    with DeviceMix() as mix:
        x = torch.ones(3, device="meta")
        torch.addcmul(k, x, x)
    assert mix.mixed and "addcmul" in mix.mixed[0]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_gpu_loss_equals_transformers_and_the_cpu_kernels(family):
    """The "standard" kernel set's loss (NextTokenLoss, what a GPU compiles) and the CPU's fused
    head (CausalLMLoss) over distlm's model, against transformers' loss on the same weights: the
    same loss and gradients to float rounding."""
    from distlm.train.kernels import CausalLMLoss, NextTokenLoss

    model, hf = tiny_model(family)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    want = hf(input_ids=ids, labels=ids).loss
    want.backward()
    for name, module in [("standard", NextTokenLoss(model)), ("cpu", CausalLMLoss(model))]:
        model.zero_grad()
        loss = module(ids)
        loss.backward()
        assert abs(loss.item() - want.item()) < 1e-5, name
        grads = model.tensor_map().to_hf({n: p.grad for n, p in model.named_parameters()})
        for k, p in hf.named_parameters():
            assert torch.allclose(grads[k], p.grad, atol=1e-6), (name, k)


def _sdpa_calls(module: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """(the loss, each SDPA call's mask, is_causal and enable_gqa) of `module` under
    torch.compile, traced by dynamo and AOT autograd and run without inductor's code generation."""
    from torch._dynamo.backends.common import aot_autograd

    calls: list[dict] = []

    def record(gm, _inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append(
                    {
                        "mask": mask is not None,
                        "is_causal": node.kwargs.get("is_causal", False),
                        "enable_gqa": node.kwargs.get("enable_gqa", False),
                    }
                )
        return gm.forward

    torch._dynamo.reset()
    loss = torch.compile(module, backend=aot_autograd(fw_compiler=lambda gm, _: gm))(ids)
    torch._dynamo.reset()
    # the graph dynamo traced, before AOT autograd lowers SDPA to its kernels
    torch.compile(module, backend=record)(ids)
    torch._dynamo.reset()
    return loss, calls


@pytest.mark.parametrize("family,n_kv_head", [("gpt2", None), ("llama", 1), ("qwen3", None)])
def test_compiled_training_attends_whole_blocks_without_a_mask(family, n_kv_head):
    """Under torch.compile the training loss attends with SDPA's is_causal and no mask (which
    CUDA runs with its flash kernel; transformers' own SDPA path built a (B, 1, T, T) mask under
    compile), grouped heads with enable_gqa, to transformers' loss and gradients."""
    from distlm.train.kernels import NextTokenLoss

    model, hf = tiny_model(family, n_kv_head=n_kv_head)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    want = hf(input_ids=ids, labels=ids).loss
    want.backward()
    loss, calls = _sdpa_calls(NextTokenLoss(model), ids)
    assert len(calls) == 2 and all(c["is_causal"] and not c["mask"] for c in calls), calls
    assert all(c["enable_gqa"] == (n_kv_head is not None) for c in calls), calls
    loss.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    grads = model.tensor_map().to_hf({n: p.grad for n, p in model.named_parameters()})
    for k, p in hf.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-6), k


# The machine modules: distlm.runtime.device (a rank's device, with torch) and distlm.runtime.machine (what the
# node has, and what runtime.device asks of it, without torch). A new device type is added there.
MACHINE_MODULES = {"device.py", "machine.py"}
DEVICE_TYPES = {"cpu", "cuda", "mps", "xpu", "hpu", "mtia"}
BACKEND_MODULES = {"cuda", "mps", "xpu", "hpu", "mtia"}  # torch.<name>: one device's API


def device_decisions(tree, ignore: frozenset[int] = frozenset()) -> list[tuple[int, str]]:
    """(line, what) for each device decision in a module's syntax tree: a comparison with a
    device type's name or with a `.type`, a use of one device's torch API (torch.cuda, ...,
    torch.backends.cuda), or a non-host device type's name (a "cpu" places on the host, which
    every machine has). Constants whose ids are in `ignore` (docstrings) are passed over."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                values = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for v in values:
                    if isinstance(v, ast.Constant) and v.value in DEVICE_TYPES:
                        found.append((node.lineno, f"compares with {v.value!r}"))
                    if isinstance(v, ast.Attribute) and v.attr == "type":
                        found.append((node.lineno, "compares a .type"))
        elif isinstance(node, ast.Attribute) and node.attr in BACKEND_MODULES:
            base = node.value
            if isinstance(base, ast.Name) and base.id == "torch":
                found.append((node.lineno, f"torch.{node.attr}"))
            if isinstance(base, ast.Attribute) and base.attr == "backends":
                found.append((node.lineno, f"torch.backends.{node.attr}"))
        elif (
            isinstance(node, ast.Constant)
            and node.value in DEVICE_TYPES - {"cpu"}
            and id(node) not in ignore
        ):
            found.append((node.lineno, f"names {node.value!r}"))
    return found


def docstrings(tree) -> set[int]:
    """The ids of a module's docstring constants (which may name a device: they decide nothing)."""
    import ast

    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def test_no_device_type_is_named_outside_the_machine_modules():
    """Every device decision of the library and the workflow's scripts goes through
    distlm.runtime.device / distlm.runtime.machine: no other module compares with a device type, asks a `.type`,
    uses one device's torch API or names a device other than the host. The config's own values
    (runtime.device's cpu | cuda | auto, a Literal in distlm.settings.runtime) are the exception:
    the settings declare them, the machine modules decide what they mean."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src/distlm").rglob("*.py"), *(root / "workflow/scripts").glob("*.py")]
    found = []
    for path in files:
        if path.name in MACHINE_MODULES and path.parent.name == "runtime":
            continue
        tree = ast.parse(path.read_text(), str(path))
        ignore = docstrings(tree)
        if path.as_posix().endswith("settings/runtime.py"):  # the config's declared values
            ignore |= {
                id(c)
                for n in ast.walk(tree)
                if isinstance(n, ast.Subscript) and getattr(n.value, "id", "") == "Literal"
                for c in ast.walk(n.slice)
            }
        for line, what in device_decisions(tree, frozenset(ignore)):
            found.append(f"{path.relative_to(root)}:{line}: {what}")
    assert not found, "\n".join(found)


def test_the_device_decision_scan_finds_what_it_looks_for():
    """The scan above on code that decides by device type (so that it cannot pass by seeing
    nothing)."""
    import ast

    code = (
        "def f(t, d, s):\n"
        "    if t.device.type == 'cuda': pass\n"
        "    if d in ('cpu', 'mps'): pass\n"
        "    torch.cuda.synchronize()\n"
        "    torch.backends.cuda.matmul\n"
        "    x = torch.device('xpu')\n"
        "    y = t.to('cpu')\n"
    )
    found = device_decisions(ast.parse(code))
    lines = sorted({line for line, _ in found})
    assert lines == [2, 3, 4, 5, 6], found
