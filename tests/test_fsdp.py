"""`train.parallel: fsdp` (FSDP2, distlm.train.parallel) on CPU ranks over gloo, through the train
stage's entry point under torchrun, on the tiny workflow's token file and base model:

- the loss curve of 20 steps equals DDP's to float rounding, at 2 and 4 ranks;
- each of 4 ranks holds at most 0.3x of what a DDP rank holds (weights, gradients, AdamW state:
  the tensors' local shards, the training record's `rank0_state_bytes`);
- the final folder is one transformers folder (AutoModelForCausalLM loads it), and computes what
  DDP's does to float rounding;
- killed on 4 ranks, the run resumes on 2 from its sharded checkpoint (torch.distributed.checkpoint
  reshards), with the same data order: every step once, the uninterrupted run's losses.

The kill-anywhere soak (tests/test_kill_soak.py) and the SLURM preemption test
(tests/test_slurm_requeue.py) run with fsdp too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY
from harness.faults import background_checkpoints_env, fault_env

from distlm.config import deep_merge, validate_config
from distlm.documents import write_document
from distlm.model import load_model_dir, read_meta
from distlm.settings.train import TrainConfig
from distlm.stages import stage_config
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


def train_cfg(**train) -> TrainConfig:
    import yaml

    tiny = yaml.safe_load(TINY.read_text())
    cfg = validate_config(deep_merge(tiny, {"train": {**TRAIN, **train}}))
    return TrainConfig.of(stage_config(cfg, "train"))


def torchrun(cfg: TrainConfig, inputs: Path, out: Path, ranks: int, env=None):
    """The train stage's entry point on `ranks` gloo ranks, as rule train starts it."""
    cfg_path = out.parent / f"{out.name}-{ranks}.json"
    write_document(cfg_path, cfg)
    r = inputs / "results"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={ranks}", "--monitor-interval=0.2", "-m", "distlm.entry.train"]
    cmd += ["--config", str(cfg_path), "--tokens", str(r / "data/tokens.h5")]
    cmd += ["--tokenizer", str(r / "data/tokenizer"), "--model", str(r / "model/base")]
    cmd += ["--out", str(out), "--rank-log", str(out / "logs" / f"rank{{rank}}-{ranks}.log")]
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
    assert last is not None and last.step == STEPS and ck.is_sharded(last)
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
    from distlm.documents import CheckpointIndex, read_document

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
    from distlm.config import validate_settings
    from distlm.documents import IdentityTopology

    base = stage_config(validate_settings({}).model_dump(), "train")
    same = validate_settings({"train": {"parallel": "ddp", "activation_checkpointing": False}})
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
