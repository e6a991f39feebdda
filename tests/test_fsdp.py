"""`train.parallel: fsdp` (FSDP2, distlm.train.parallel) on CPU ranks over gloo, through the train
stage's entry point under torchrun, on the tiny workflow's token file and base model:

- the loss curve of 20 steps equals DDP's to float rounding, at 2 and 4 ranks;
- each of 4 ranks holds at most 0.3x of what a DDP rank holds (weights, gradients, AdamW state:
  the tensors' local shards, the training record's `rank0_state_bytes`);
- the final folder is one transformers folder (AutoModelForCausalLM loads it), and computes what
  DDP's does to float rounding;
- killed on 4 ranks, the run resumes on 2 from its sharded checkpoint (torch.distributed.checkpoint
  reshards), with the same data order: every step once, the uninterrupted run's losses; and so
  through the user's command (`snakemake --profile profiles/local`, killed with its process group);
- validation with unequal shares (22 blocks on 4 ranks, micro-batches of 5: 2, 2, 1, 1 passes)
  finishes, with DDP's validation loss;
- any rank's failure in a sharded save fails every rank, with one error naming the rank and the
  file, within the transfer timeout;
- the layouts' own checks (tests/harness/layout_check.py, one torchrun of 4 ranks): the mesh is the
  topology's; the fused-head loss does not depend on when FSDP reshards; what a rank holds after
  each backward pass (measured: tests/harness/held.py) is what the admission check counts, with
  and without whole gradients under accumulation; no rank holds the whole model at start-up;
  activation checkpointing changes no number and keeps less; fsdp in bf16 trains what DDP's bf16
  autocast does, to bf16's rounding;
- no module outside the layouts branches on the layout.

The kill-anywhere soak (tests/test_kill_soak.py) and the SLURM preemption test
(tests/test_slurm_requeue.py) run with fsdp too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, copy_workflow, snakemake_cmd
from harness.faults import background_checkpoints_env, fault_env, paced_env, save_fault_env
from procs import alive, children

from distlm.core.documents import write_document
from distlm.dag.config import deep_merge, validate_config
from distlm.dag.stages import stage_config
from distlm.launch.torchrun import local_torchrun, stage_args, train_args
from distlm.model import load_model_dir, read_meta
from distlm.settings.train import TrainConfig
from distlm.train import checkpoint as ck
from distlm.train import identity as ident

STEPS = 20
TRAIN = {
    "max_steps": STEPS,
    "micro_batch_size": 2,
    "global_batch_size": 8,  # any world size: 2 ranks x 2 x accum 2, or 4 ranks x 2
    "ckpt_every": 5,
    "eval_every": 10,
    "keep_last": 2,
    "profile": {"enabled": False},
}


def train_cfg(overlay: dict | None = None, **train) -> TrainConfig:
    import yaml

    tiny = yaml.safe_load(TINY.read_text())
    cfg = validate_config(deep_merge(tiny, {"train": {**TRAIN, **train}, **(overlay or {})}))
    return TrainConfig.of(stage_config(cfg, "train"))


def torchrun(cfg: TrainConfig, inputs: Path, out: Path, ranks: int, env=None, tokens=None):
    """The train stage's entry point on `ranks` gloo ranks, as rule train starts it."""
    cfg_path = out.parent / f"{out.name}-{ranks}.json"
    write_document(cfg_path, cfg)
    r = inputs / "results"
    args = train_args(
        config=cfg_path,
        tokens=tokens or r / "data/tokens.h5",
        tokenizer=r / "data/tokenizer",
        model=r / "model/base",
        out=out,
        rank_log=out / "logs" / f"rank{{rank}}-{ranks}.log",
    )
    cmd = local_torchrun(
        stage_args("train", nproc=ranks, launcher=["--monitor-interval=0.2"], args=args)
    )
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)


def trained(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of each row of metrics.csv."""
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    return [(int(r.split(",")[0]), float(r.split(",")[1])) for r in rows]


@pytest.fixture(scope="module")
def runs(workflow_run, tmp_path_factory) -> dict:
    """ddp and fsdp, at 2 and 4 ranks: each run's folder."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for ranks in (2, 4):
        for parallel in ("ddp", "fsdp"):
            folder = root / f"{parallel}-{ranks}"
            proc = torchrun(train_cfg(parallel=parallel), workflow_run, folder, ranks)
            assert proc.returncode == 0, proc.stderr[-4000:]
            out[parallel, ranks] = folder
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_trains_what_ddp_trains(runs, ranks):
    ddp, fsdp = trained(runs["ddp", ranks]), trained(runs["fsdp", ranks])
    assert [s for s, _ in fsdp] == list(range(1, STEPS + 1))
    assert [loss for _, loss in fsdp] == pytest.approx([loss for _, loss in ddp], rel=1e-5)
    assert fsdp[-1][1] < fsdp[0][1]
    meta = read_meta(runs["fsdp", ranks] / "final").training
    assert meta["parallel"] == "fsdp" and meta["world_size"] == ranks
    # the final folder: whole, transformers', DDP's weights to float rounding
    from transformers import AutoModelForCausalLM

    final = runs["fsdp", ranks] / "final"
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = load_model_dir(final)
    assert set(ours.hf_tensors()) == {n for n, _ in hf.named_parameters()}
    # the same function as DDP's: the weights differ in rounding, and a key's bias, whose
    # gradient is rounding noise (softmax ignores it), moves by +-lr either way under AdamW:
    # compared by what the model computes
    ddp_model = load_model_dir(runs["ddp", ranks] / "final")
    x = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ddp_model(x), rtol=1e-4, atol=1e-4)
    # the sharded checkpoints: every rank's shards, verified
    ((run, _),) = ident.list_runs(runs["fsdp", ranks] / "checkpoints")
    last = ck.latest_good(run)
    assert last is not None and last.step == STEPS and ck.kind_of(last) == ck.SHARDED
    assert len(list((last.path / ck.SHARDS).glob("*.distcp"))) == ranks


def test_each_of_4_fsdp_ranks_holds_under_a_third_of_a_ddp_rank(runs):
    """Weights, gradients and AdamW's state: the tensors' local shards on rank 0, against a DDP
    rank's whole tensors (4 ranks: a quarter, and what does not divide)."""
    ddp = read_meta(runs["ddp", 4] / "final").training["rank0_state_bytes"]
    fsdp = read_meta(runs["fsdp", 4] / "final").training["rank0_state_bytes"]
    assert set(ddp) == set(fsdp) == {"parameters", "gradients", "optimizer"}
    assert sum(fsdp.values()) <= 0.3 * sum(ddp.values()), (fsdp, ddp)
    assert all(fsdp[k] < ddp[k] for k in ddp)


def test_killed_on_4_ranks_a_sharded_run_resumes_on_2(runs, workflow_run, tmp_path):
    """The run on 4 ranks, SIGKILLed after step 12 (its checkpoint of step 10 on disk), resumed
    on 2 ranks: torch.distributed.checkpoint reshards the weights and AdamW's state; the same
    global batches in the same order, so every step once and the uninterrupted run's losses."""
    out = tmp_path / "killed"
    cfg = train_cfg(parallel="fsdp")
    faults = fault_env(tmp_path / "faults.json", kill_after_step=12)
    first = torchrun(cfg, workflow_run, out, 4, env=faults)
    assert first.returncode != 0
    second = torchrun(cfg, workflow_run, out, 2)
    assert second.returncode == 0, second.stderr[-4000:]
    log = (out / "logs" / "rank0-2.log").read_text()
    assert "made by 4 ranks, resumed by 2" in log and "resuming from" in log
    resumed = trained(out)
    assert [s for s, _ in resumed] == list(range(1, STEPS + 1))  # no step lost or twice
    want = [loss for _, loss in trained(runs["fsdp", 4])]
    assert [loss for _, loss in resumed] == pytest.approx(want, rel=1e-5)
    meta = read_meta(out / "final").training
    assert meta["world_size"] == 2 and meta["resumed_from"].endswith("step-00000010")
    assert meta["steps"] == STEPS


def test_background_sharded_checkpoints_hold_what_the_loop_saved(runs, workflow_run, tmp_path):
    """The GPU's checkpoint policy on CPU ranks: each rank copies its shards to host memory in
    the loop and torch.distributed.checkpoint writes them in a thread, rank 0 then the rest in
    its own; the loop goes on meanwhile. Every checkpoint holds its own step's shards, byte for
    byte those written in the loop, and the run ends as it does with writes in the loop."""
    out = tmp_path / "background"
    proc = torchrun(
        train_cfg(parallel="fsdp"),
        workflow_run,
        out,
        2,
        env=background_checkpoints_env(dict(os.environ)),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "written in the background" in (out / "logs" / "rank0-2.log").read_text()
    assert trained(out) == trained(runs["fsdp", 2])
    ((here, _),) = ident.list_runs(out / "checkpoints")
    ((there, _),) = ident.list_runs(runs["fsdp", 2] / "checkpoints")
    mine, theirs = ck.list_checkpoints(here), ck.list_checkpoints(there)
    assert [c.step for c in mine] == [c.step for c in theirs] == [15, 20]  # keep_last 2
    for a, b in zip(mine, theirs, strict=True):
        ck.verify(a)
        shards = {k: v for k, v in _index(a).items() if k.endswith(".distcp")}
        assert len(shards) == 2 and shards == {
            k: v for k, v in _index(b).items() if k.endswith(".distcp")
        }
    meta = read_meta(out / "final").training
    assert len(meta["checkpoint_write_s"]) == len(meta["checkpoint_stall_s"]) == 4
    fa, fb = (load_model_dir(d / "final").state_dict() for d in (out, runs["fsdp", 2]))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def _index(c: ck.Checkpoint) -> dict[str, str]:
    """A checkpoint's files and their sha256, as its checkpoint.json holds them."""
    from distlm.core.documents import read_document
    from distlm.model.documents import CheckpointIndex

    return read_document(c.path / "checkpoint.json", CheckpointIndex).sha256


def test_a_sharded_checkpoint_that_does_not_verify_is_passed_over(runs, tmp_path):
    """A shard changed after its checkpoint was written: the checkpoint is skipped for the one
    before it, naming the file (its sha256 is in checkpoint.json)."""
    import shutil

    ((run, _),) = ident.list_runs(runs["fsdp", 2] / "checkpoints")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = ck.list_checkpoints(copy)[-1]
    shard = next((newest.path / ck.SHARDS).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    with pytest.raises(Exception, match=f"{shard.name}: sha256 .* does not match"):
        ck.verify(newest)
    good = ck.latest_good(copy)
    assert good is not None and good.step < newest.step


def test_ddp_configs_digest_as_before_and_fsdp_is_a_run_of_its_own():
    """train.parallel and activation_checkpointing at their defaults are not dumped: a config
    without them has the train stage's params it had; a DDP run identity digests as before
    (its topology's four keys), an FSDP one holds the global batch alone (it reshards)."""
    from distlm.dag.config import validate_settings
    from distlm.train.documents import IdentityTopology

    base = stage_config(validate_settings({}).model_dump(), "train")
    same = validate_settings(
        {
            "train": {
                "parallel": "ddp",
                "activation_checkpointing": False,
                "fsdp": {"reduce_every_micro_batch": True},
            }
        }
    )
    assert stage_config(same.model_dump(), "train") == base
    assert "parallel" not in json.dumps(base)
    fsdp = validate_settings({"train": {"parallel": "fsdp"}}).model_dump()
    assert stage_config(fsdp, "train")["train"]["parallel"] == "fsdp"
    ddp = IdentityTopology(world_size=2, micro_batch=4, grad_accum=1, global_batch=8)
    assert ddp.model_dump() == {
        "world_size": 2,
        "micro_batch": 4,
        "grad_accum": 1,
        "global_batch": 8,
    }
    sharded = IdentityTopology(global_batch=8, parallel="fsdp")
    assert sharded.model_dump() == {"global_batch": 8, "parallel": "fsdp"}


# ----------------------------------------------------------------------------- validation


def _tokens_with_validation(src: Path, dest: Path, blocks: int) -> Path:
    """A token store (dest and its shard) as `src`'s, whose validation split holds the first
    `blocks` blocks of src's alone."""
    from harness.synthetic import write_tokens

    from distlm.data.tokens import TokenBlocks, read_tokens_meta

    meta = read_tokens_meta(src)
    streams = {}
    for split in ("train", "validation", "test"):
        tb = TokenBlocks(src, split)
        n = blocks * tb.block_size if split == "validation" else tb.n_tokens
        assert n <= tb.n_tokens, (split, n, tb.n_tokens)
        streams[split] = tb.read(0, n)
    write_tokens(dest, streams, meta.block_size, meta.vocab_size, meta)
    assert TokenBlocks(dest, "validation").n_blocks == blocks
    return dest


def test_fsdp_validation_with_unequal_shares_finishes_with_ddps_loss(workflow_run, tmp_path):
    """22 validation blocks on 4 ranks in micro-batches of 5 (the embedded default's split with
    `micro_batch_size: 5`): shares of 6, 6, 5 and 5 blocks, so 2, 2, 1 and 1 forward passes of
    their own. Every FSDP pass all-gathers, so every rank runs 2 (the extra ones do not count):
    the validation finishes, with the loss DDP computes over the same blocks."""
    tokens = _tokens_with_validation(
        workflow_run / "results/data/tokens.h5", tmp_path / "tokens-22.h5", 22
    )
    train = {"micro_batch_size": 5, "global_batch_size": 20, "max_steps": 2, "eval_every": 1}
    train |= {"eval_batches": 2, "ckpt_every": 2}
    fast = {"runtime": {"timeout_s": 30}}  # a hang (the defect) fails in seconds, not minutes
    losses = {}
    for parallel in ("ddp", "fsdp"):
        out = tmp_path / parallel
        cfg = train_cfg(fast, **train, parallel=parallel)
        proc = torchrun(cfg, workflow_run, out, 4, tokens=tokens)
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = (out / "val.csv").read_text().splitlines()[1:]
        losses[parallel] = [float(r.split(",")[1]) for r in rows]
    assert len(losses["fsdp"]) == 2
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)


# ----------------------------------------------------------------------------- a failed save


@pytest.mark.parametrize(("rank", "at"), [(0, "open"), (1, "shards")])
def test_a_failed_sharded_save_fails_every_rank_naming_it(workflow_run, tmp_path, rank, at):
    """A full disk in the first sharded checkpoint, on one rank: rank 0 opening the checkpoint's
    folder, or rank 1 writing its shards. Every rank stops with the same error, which names the
    rank and the file, within the transfer timeout (no rank waits in a collective for the one
    that failed); nothing that looks like a checkpoint is left."""
    timeout_s = 15
    out = tmp_path / "failed"
    cfg = train_cfg({"transfer": {"timeout_s": timeout_s}}, parallel="fsdp")
    env = save_fault_env({**os.environ}, rank=rank, at=at)
    started = time.monotonic()
    proc = torchrun(cfg, workflow_run, out, 2, env=env)
    took = time.monotonic() - started
    assert proc.returncode != 0
    assert took < 60 + timeout_s, took  # start-up and 5 steps, then at most the timeout
    file = "step-00000005" if at == "open" else f"__{rank}_0.distcp"
    for r in range(2):  # each rank's own error (torchrun prefixes its lines with the rank)
        said = [
            line
            for line in proc.stderr.splitlines()
            if line.startswith(f"[rank{r}]: distlm.DistlmError") and f"rank {rank} failed" in line
        ]
        assert said and file in said[0] and "No space left on device" in said[0], proc.stderr[
            -4000:
        ]
    ((run, _),) = ident.list_runs(out / "checkpoints")
    assert ck.list_checkpoints(run) == []  # a leftover at most, which the next start removes


# ----------------------------------------------------------------------------- the layouts


LAYOUT_RUNS = {  # name: (the run's train settings, measured)
    "ddp": ({"parallel": "ddp"}, True),
    "fsdp": ({"parallel": "fsdp"}, True),
    "fsdp_last": ({"parallel": "fsdp", "fsdp": {"reduce_every_micro_batch": False}}, True),
    "ddp_ac": ({"parallel": "ddp", "activation_checkpointing": True}, False),
    "fsdp_ac": ({"parallel": "fsdp", "activation_checkpointing": True}, False),
    "ddp_bf16": ({"parallel": "ddp", "precision": "bf16"}, False),
    "fsdp_bf16": ({"parallel": "fsdp", "precision": "bf16"}, False),
}


@pytest.fixture(scope="module")
def layouts(workflow_run, tmp_path_factory) -> list[dict]:
    """tests/harness/layout_check.py on 4 gloo ranks: each rank's results (see its doc). Every
    run accumulates 2 micro-batches a step (16 blocks a step, 2 a micro-batch, on 4 ranks)."""
    out = tmp_path_factory.mktemp("layouts")
    base = {"micro_batch_size": 2, "global_batch_size": 16, "eval_batches": 1}
    spec: dict = {}
    for name, (train, measure) in LAYOUT_RUNS.items():
        write_document(out / f"{name}.json", train_cfg(**{**base, **train}))
        spec[name] = {"config": str(out / f"{name}.json"), "steps": 2, "measure": measure}
    for check in ("mesh", "reshard"):
        spec[check] = spec["fsdp"]
    (out / "runs.json").write_text(json.dumps(spec))
    tests = Path(__file__).resolve().parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["--monitor-interval=0.2", "-m", "harness.layout_check"]
    cmd += [str(workflow_run), str(out), str(out / "runs.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tests)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_the_mesh_comes_from_the_topology(layouts):
    """Every sharded parameter lies on the topology's mesh, on the ranks' own device type, and
    FSDP's default mesh (the accelerator's, on a host with GPUs) is never made."""
    for rank in layouts:
        assert rank["mesh"] == {
            "one_mesh_the_topologys": True,
            "device_types": ["cpu"],
            "mesh_ranks": 4,
        }


def test_the_loss_does_not_depend_on_when_fsdp_reshards(layouts):
    """The fused-head loss (the CPU's kernels) reads the head's weight inside the model's forward
    pass: with the root resharded right after its forward (FSDPModule.reshard in a hook), the
    loss and every gradient are what they are without."""
    for rank in layouts:
        r = rank["reshard"]
        assert r["module"] == "CausalLMLoss"
        assert r["resharded"] == r["plain"] and r["same_grads"]


SMALL = 4096  # the loop's own small tensors: AdamW's step counts, the loss, the next batch


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_last"])
def test_a_rank_holds_after_each_backward_what_the_admission_check_counts(layouts, name):
    """Measured (every tensor storage torch allocated, tests/harness/held.py) after each micro-
    step's backward pass once AdamW has its state, with 2 micro-steps a step: a rank holds what
    the layout's rule counts as held between steps (model state; whole float32 gradients while
    accumulating under reduce_every_micro_batch false) and no more. The rule's total adds the
    weights a sharded rank gathers for a while (not held after a backward pass)."""
    for rank in layouts:
        r = rank[name]
        assert r["grad_accum"] == 2
        p = r["predicted"]
        between = p["state"] + p["accumulated"]
        assert 0.8 * between <= r["after_backward_bytes"] <= between + SMALL, (name, r)
        assert r["after_backward_bytes"] <= sum(p.values()) + SMALL
    # whole gradients between micro-steps cost what the rule says they do, and only when asked
    assert layouts[0]["fsdp"]["predicted"]["accumulated"] == 0
    last, every = layouts[0]["fsdp_last"], layouts[0]["fsdp"]
    assert (
        last["after_backward_bytes"]
        > every["after_backward_bytes"] + 0.5 * (last["predicted"]["accumulated"])
    )


def test_no_fsdp_rank_holds_the_whole_model_at_start_up(layouts):
    """The most tensor memory any rank holds while it starts (the model built, its weights read),
    measured: under fsdp the model is built on the meta device, sharded, and each rank reads its
    own rows of the base folder, so a rank holds at most 0.3x of what DDP's rank 0 holds."""
    ddp = max(rank["ddp"]["startup_bytes"] for rank in layouts)
    fsdp = max(rank["fsdp"]["startup_bytes"] for rank in layouts)
    assert 0 < fsdp <= 0.3 * ddp, (fsdp, ddp)


def test_activation_checkpointing_changes_no_number_and_keeps_less(layouts):
    """train.activation_checkpointing under both layouts: the same losses and validation loss (to
    float rounding), and what autograd keeps for the backward pass of one forward (measured:
    saved tensors that are no parameter) is under half of what it keeps without."""
    for rank in layouts:
        for layout in ("ddp", "fsdp"):
            off, on = rank[layout], rank[f"{layout}_ac"]
            assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
            assert on["val_loss"] == pytest.approx(off["val_loss"], rel=1e-6)
        assert rank["ddp_ac"]["activation_bytes"] < 0.5 * rank["ddp"]["activation_bytes"]


def test_fsdp_in_bf16_trains_what_ddp_autocast_does_to_bf16_rounding(layouts):
    """precision bf16 on the CPU: DDP computes under bf16 autocast over float32 weights, fsdp with
    bf16 parameters gathered (its MixedPrecisionPolicy), so its residual stream is bf16 too
    (docs/parallelism.md). Both differ from float32's losses, and agree with each other within
    2e-3 relative (bf16 keeps 8 bits: 7.8e-3); their float32 runs agree to 1e-6."""
    for rank in layouts:
        ddp, fsdp = rank["ddp_bf16"], rank["fsdp_bf16"]
        assert ddp["losses"] != rank["ddp"]["losses"] and fsdp["losses"] != rank["fsdp"]["losses"]
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=2e-3)
        assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=2e-3)
        assert rank["fsdp"]["losses"] == pytest.approx(rank["ddp"]["losses"], rel=1e-6)


# ----------------------------------------------------------------------------- the user's command


def test_a_sharded_run_killed_on_4_ranks_resumes_on_2_through_the_workflow(
    runs, workflow_run, tmp_path
):
    """The user's command, `snakemake --profile profiles/local results/train/final`, with
    train.parallel fsdp on 4 ranks, killed with its whole process group (SIGKILL) once a
    checkpoint is written; then the user's next commands: `--unlock`, and the same target with
    train.nproc_per_node 2. No process of the first job outlives the kill; the rerun resumes
    from the sharded checkpoint on 2 ranks (resharded), trains every step once, and ends with
    the uninterrupted 4-rank run's losses."""
    work = copy_workflow(workflow_run, tmp_path / "work", without=("results/train", "logs/train"))
    # the uninterrupted run's train settings (config/config.yaml's lr lies under the tiny config)
    same = {"lr": 0.001, "min_lr": 0.0001}
    overlay = {"train": {**TRAIN, **same, "parallel": "fsdp", "nproc_per_node": 4}}
    (tmp_path / "fsdp4.yaml").write_text(json.dumps(overlay))
    cmd = snakemake_cmd(work, "results/train/final", configfiles=(TINY, tmp_path / "fsdp4.yaml"))
    env = paced_env({**os.environ, "OMP_NUM_THREADS": "1"}, 0.5)  # 20 steps: >= 10 s
    job = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: set[int] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        todo = [job.pid]
        while todo:  # Snakemake -> shell -> torchrun -> ranks
            kids = children(todo.pop())
            pids.update(kids)
            todo.extend(kids)
        if list((work / "results/train/checkpoints").glob("*/step-*")):
            break
        time.sleep(0.2)
    assert job.poll() is None, "the job ended before its first checkpoint"
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    gone = time.monotonic() + 10
    while time.monotonic() < gone and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes of the killed job run on"
    subprocess.run(
        snakemake_cmd(work, "--unlock", configfiles=(TINY, tmp_path / "fsdp4.yaml")),
        check=True,
        capture_output=True,
    )
    overlay["train"]["nproc_per_node"] = 2
    (tmp_path / "fsdp2.yaml").write_text(json.dumps(overlay))
    again = snakemake_cmd(work, "results/train/final", configfiles=(TINY, tmp_path / "fsdp2.yaml"))
    proc = subprocess.run(again, capture_output=True, text=True, env=dict(env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    meta = read_meta(work / "results/train/final").training
    assert meta["world_size"] == 2 and meta["parallel"] == "fsdp"
    assert "step-" in str(meta["resumed_from"])
    resumed = trained(work / "results/train")
    assert [s for s, _ in resumed] == list(range(1, STEPS + 1))  # no step lost or twice
    want = [loss for _, loss in trained(runs["fsdp", 4])]
    assert [loss for _, loss in resumed] == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- one object


LAYOUT_MODULES = {"train/parallel.py", "settings/layout_rules.py", "settings/train.py"}
LAYOUT_NAMES = {"ddp", "fsdp"}


def layout_branches(tree) -> list[tuple[int, str]]:
    """(line, what) for each place a module's syntax tree decides by the layout: a comparison
    with a layout's name or with a `.parallel`, or a `sharded` / `is_sharded` flag."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                values = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for v in values:
                    if isinstance(v, ast.Constant) and v.value in LAYOUT_NAMES:
                        found.append((node.lineno, f"compares with {v.value!r}"))
                    if isinstance(v, ast.Attribute) and v.attr == "parallel":
                        found.append((node.lineno, "compares a .parallel"))
        elif isinstance(node, ast.Attribute) and node.attr in ("sharded", "is_sharded"):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in ("sharded", "is_sharded"):
            found.append((node.lineno, node.id))
    return found


def test_nothing_outside_the_layouts_branches_on_the_layout():
    """What differs between ddp and fsdp is asked of the layout (distlm.train.parallel) or its
    torch-free rule (distlm.settings.layout_rules); no other module of the library or the workflow's
    scripts compares train.parallel or keeps a `sharded` flag."""
    import ast

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src/distlm").rglob("*.py"), *(root / "workflow/scripts").glob("*.py")]
    found = []
    for path in files:
        rel = path.relative_to(root / "src/distlm").as_posix() if "src" in path.parts else ""
        if rel in LAYOUT_MODULES:
            continue
        for line, what in layout_branches(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(root)}:{line}: {what}")
    assert not found, "\n".join(found)


def test_the_layout_branch_scan_finds_what_it_looks_for():
    import ast

    code = (
        "def f(t, state):\n"
        "    if t.parallel == 'ddp': pass\n"
        "    if state.sharded: pass\n"
        "    if mode in ('fsdp', 'x'): pass\n"
        "    if is_sharded(c): pass\n"
        "    x = t.parallel\n"
    )
    lines = sorted({line for line, _ in layout_branches(ast.parse(code))})
    assert lines == [2, 3, 4, 5]
