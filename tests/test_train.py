"""DDP training stage: schedule, sampler, checkpoints (unit); world-of-one runs in process (NaN,
refusals, bad input); a 2-rank gloo run under torchrun killed and restarted (bit-identical resume);
the stage inside the tiny workflow (profiler on)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from harness.faults import fault_env, inject
from harness.synthetic import checkpoint_state, make_inputs, run_identity

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.core.io import digest
from distlm.dag.config import validate_config
from distlm.dag.stages import stage_config
from distlm.data.documents import TokenMeta
from distlm.launch.torchrun import local_torchrun, stage_args, train_args
from distlm.model import load_model_dir, read_meta
from distlm.model.documents import ModelMeta
from distlm.runtime.device import DeviceBackend
from distlm.runtime.host import threads_per_rank
from distlm.settings import TrainSettings
from distlm.settings.train import TrainConfig
from distlm.train import TrainingDiverged, TrainPaths, lr_at, run_training
from distlm.train import checkpoint as ck
from distlm.train import faults as faults_mod
from distlm.train import identity as ident
from distlm.train.checkpoint_writer import CheckpointWriter
from distlm.train.kernels import CausalLMLoss, NextTokenLoss, linear_cross_entropy
from distlm.train.step_sampler import BatchPlan, StepSampler, plan_batch
from distlm.train.trainer import fused_adamw_available

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "distlm.entry.train"  # the stage entry point, as rule train starts it


def train_cfg(**train) -> TrainConfig:
    base = {
        "max_steps": 6,
        "micro_batch_size": 4,
        "warmup_steps": 2,
        "lr": 0.01,
        "min_lr": 0.001,
        "ckpt_every": 2,
        "eval_every": 3,
        "eval_batches": 2,
        "keep_last": 2,
        "profile": {"enabled": False},
    }
    for k, v in train.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    cfg = validate_config(
        {
            "runtime": {"timeout_s": 60},
            "transfer": {"bucket_mb": 0.25, "chunk_mb": 0.0625, "timeout_s": 60},
            "train": base,
        }
    )
    return TrainConfig.of(stage_config(cfg, "train"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    return make_inputs(tmp_path_factory.mktemp("train-inputs"))


def only_run(out: Path) -> Path:
    """The one run folder (run identity) under a stage folder's checkpoints."""
    (run,) = [r for r, _ in ident.list_runs(out / "checkpoints")]
    return run


def paths(inputs, out: Path, **over) -> TrainPaths:
    return TrainPaths(
        tokens=over.get("tokens", inputs["tokens"]),
        model=over.get("model", inputs["model"]),
        tokenizer=inputs["tokenizer"],
        out=out,
    )


# ----------------------------------------------------------------------------- unit


def test_lr_schedule_warmup_then_cosine_to_min():
    t = TrainSettings(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=20)
    lrs = [lr_at(s, t) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert lrs[-1] > t.min_lr and lr_at(20, t) == pytest.approx(0.1)


def test_global_batch_must_divide():
    assert plan_batch(TrainSettings(micro_batch_size=4, global_batch_size=32), 2).grad_accum == 4
    with pytest.raises(DistlmError, match="train.global_batch_size: 30 is not divisible"):
        plan_batch(TrainSettings(micro_batch_size=4, global_batch_size=30), 2)


# The run identities of three train configs as distlm computed them before typed settings
# (commit f6845ef, dict configs), with the file-derived parts fixed: the typed trainer must find
# those runs' checkpoints, so it must compute the same identities.
IDENTITIES_BEFORE = {
    "default": ({}, "bc526e6333982684"),
    "config.yaml": (yaml.safe_load((ROOT / "config/config.yaml").read_text()), "54c90b28536240ca"),
    "int-reals": (
        {
            "train": {
                "lr": 1,
                "min_lr": 0,
                "weight_decay": 0,
                "grad_clip": 2,
                "beta1": 0,
                "global_batch_size": 32,
            }
        },
        "67273c63715f60f3",
    ),
}


@pytest.mark.parametrize("name", list(IDENTITIES_BEFORE))
def test_run_identity_is_unchanged_by_typed_settings(name):
    raw, before = IDENTITIES_BEFORE[name]
    cfg = TrainConfig.of(stage_config(validate_config(raw), "train"))
    identity = ident.run_identity(
        cfg,
        base=ModelMeta.model_construct(arch_digest="a" * 64, model_sha256="b" * 64),
        data=TokenMeta.model_construct(config_digest="c" * 64),
        block_size=128,
        train_blocks=1000,
        plan=plan_batch(cfg.train, 2),
        precision="fp32",
    )
    assert identity.run_id == before


def test_sampler_ranks_disjoint_and_epoch_covers_every_block():
    plan = BatchPlan(micro_batch=2, grad_accum=3, world_size=2)  # 12 blocks per step
    samplers = [StepSampler(24, plan, r, seed=7) for r in range(2)]
    seen = []
    for step in range(2):  # 2 steps x 12 = one epoch of 24 blocks
        parts = [s.indices(step) for s in samplers]
        assert parts[0].shape == (3, 2)
        assert not set(parts[0].ravel()) & set(parts[1].ravel())
        seen += [int(i) for p in parts for i in p.ravel()]
    assert sorted(seen) == list(range(24))
    again = StepSampler(24, plan, 1, seed=7)
    assert (again.indices(5) == samplers[1].indices(5)).all()  # pure function of the step
    with pytest.raises(DistlmError, match="no blocks"):
        StepSampler(0, plan, 0, seed=7)


def test_threads_per_rank_never_oversubscribes():
    # Snakemake's OMP_NUM_THREADS is the job's total: 2 ranks on 2 cores get one thread each
    assert threads_per_rank({"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "2"}, 2) == 1
    assert threads_per_rank({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, 16) == 1
    assert threads_per_rank({"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2"}, 16) == 4
    assert threads_per_rank({"LOCAL_WORLD_SIZE": "4"}, 16) == 4  # unset: the core share
    assert threads_per_rank({"LOCAL_WORLD_SIZE": "4"}, 2) == 1
    assert threads_per_rank({}, 8) == 8


@pytest.mark.parametrize("loss", ["fused", "fused-rows-7", "standard"])
def test_training_losses_match_transformers_loss_and_gradients(inputs, loss):
    """Each loss module over distlm's GPT-2 (the CPU's fused head, in one chunk and in several,
    the last one short; the standard one) gives transformers' loss and gradients on the same
    weights to float rounding (GPT-2's gelu_new is torch's tanh GELU)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(inputs["model"], dtype=torch.float32).train()
    fast = load_model_dir(inputs["model"]).train()
    x = torch.randint(0, fast.args.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=x, labels=x).loss
    want.backward()
    module = NextTokenLoss(fast) if loss == "standard" else CausalLMLoss(fast)
    if loss == "fused-rows-7":  # several chunks, the last one short
        h = fast(x, head=False)
        got_loss = linear_cross_entropy(h[:, :-1], fast.lm_head.weight, x[:, 1:], rows=7)
    else:
        got_loss = module(x)
    (2.0 * got_loss).backward()  # backward scales by the incoming gradient
    assert got_loss.item() == pytest.approx(want.item(), rel=1e-6)
    grads = fast.tensor_map().to_hf({n: p.grad for n, p in fast.named_parameters()})
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], 2.0 * p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: the loss alone
        assert module(x).item() == pytest.approx(ref(input_ids=x, labels=x).loss.item(), rel=1e-6)


@pytest.mark.parametrize(("vocab", "width", "rows"), [(512, 32, 7), (9000, 240, None)])
def test_linear_cross_entropy_matches_the_logits_path(vocab, width, rows):
    """Against cross-entropy of the whole logits: several short chunks, and a head beyond the
    caches (8.6 MB) that the default chunking takes in chunks of at least 256 rows."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, width, generator=g)
    w = torch.randn(vocab, width, generator=g) * 0.05
    t = torch.randint(0, vocab, (300,), generator=g)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h1 @ w1.t(), t)
    (3.0 * want).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_cross_entropy(h2, w2, t, rows=rows)
    (3.0 * got).backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-4, atol=1e-7)


def test_linear_cross_entropy_refuses_a_second_backward_instead_of_scaling_twice():
    """Its backward scales the gradient sums made in forward in place: a second backward through
    the same graph (retain_graph) must fail loudly, never hand out gradients scaled twice."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(100, 16, generator=g, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 100, (40,), generator=g), rows=16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _save(d: Path, step: int, keep: int = 10) -> None:
    """Rank 0's part of the save path (checkpoint.write) with small stand-in tensors."""
    ck.write(
        d,
        weights={"w": torch.full((4,), float(step))},
        optimizer_state={"state": {}, "param_groups": []},
        rng_states=[DeviceBackend.cpu().rng_state()],
        state=checkpoint_state(step),
        keep_last=keep,
    )


def test_checkpoints_keep_last_and_skip_corrupt(tmp_path, caplog):
    for s in (2, 4, 6, 8):
        _save(tmp_path, s, keep=3)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [4, 6, 8]
    # a truncated weights file in the newest, and a partial one (no index) above it
    w = tmp_path / "step-00000008" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:20])
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / ".step-00000012.abc.tmp").mkdir()  # an interrupted write: ignored
    with caplog.at_level(logging.WARNING, logger="distlm"):
        good = ck.latest_good(tmp_path)
    assert good.step == 6
    assert "step-00000010" in caplog.text and "step-00000008" in caplog.text
    assert "sha256" in caplog.text and "CheckpointIndex not found" in caplog.text


def test_identity_mismatch_names_what_differs(tmp_path):
    c = ck.Checkpoint(tmp_path / "step-00000002", 2)
    saved = run_identity(arch_digest="aaa", max_steps=10)
    ident.check_identity(c, saved, run_identity(arch_digest="aaa", max_steps=20))  # tolerated
    with pytest.raises(
        ck.CheckpointMismatch, match=r"model.arch_digest: checkpoint 'aaa', this run 'bbb'"
    ):
        ident.check_identity(c, saved, run_identity(arch_digest="bbb", max_steps=10))


# ----------------------------------------------------------------------------- world of one


def test_nan_loss_stops_and_keeps_last_good_checkpoint(inputs, tmp_path, monkeypatch):
    out = tmp_path / "train"
    inject(monkeypatch, nan_at_step=3)
    with pytest.raises(TrainingDiverged, match="step 3: loss nan"):
        run_training(train_cfg(), paths(inputs, out))
    assert [c.step for c in ck.list_checkpoints(only_run(out))] == [2]
    ck.verify(ck.latest_good(only_run(out)))
    assert not (out / "final").exists()


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "diverged"])
def test_ddp_is_gone_before_the_process_group(inputs, tmp_path, monkeypatch, fails):
    """DDP's C++ reducer holds the process group. Freed after destroy_process_group (at the end of
    run_training's frame), the group's last reference went with the reducer, and gloo's destructor
    ran with the GIL held: it joins gloo's worker threads while one of them waits for the GIL to
    free the last collective's tensors. A finished 2-rank training hung at exit that way (py-spy:
    ~ProcessGroupGloo inside the Reducer's dealloc). No DDP may be alive when the group goes."""
    alive: list[int] = []
    destroy = torch.distributed.destroy_process_group

    def spy(*args, **kwargs):
        gc.collect()
        alive.append(
            sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
        )
        return destroy(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "destroy_process_group", spy)
    out = tmp_path / "train"
    if fails:
        inject(monkeypatch, nan_at_step=2)
        with pytest.raises(TrainingDiverged):
            run_training(train_cfg(max_steps=3), paths(inputs, out))
    else:
        run_training(train_cfg(max_steps=2), paths(inputs, out))
        assert (out / "final").is_dir()
    assert alive == [0]


def test_reference_kernels_train_to_the_same_losses(inputs, tmp_path):
    """train.fast_kernels: false (transformers' modules) and true agree to float rounding."""
    rows = {}
    for fast in (True, False):
        out = tmp_path / f"fast-{fast}"
        run_training(train_cfg(max_steps=3, fast_kernels=fast), paths(inputs, out))
        text = (out / "metrics.csv").read_text().splitlines()
        rows[fast] = [float(r.split(",")[1]) for r in text[1:]]
    assert rows[True] == pytest.approx(rows[False], rel=1e-4)


def test_an_edit_trains_its_own_run_and_a_revert_finds_the_old_one(inputs, tmp_path, caplog):
    """Checkpoints belong to a run identity: an edit that changes it (model, lr, max_steps)
    trains in a folder of its own and deletes nothing; reverting finds the finished run again
    (no step runs); a larger max_steps extends a finished run; keep_runs prunes the oldest."""
    out = tmp_path / "train"
    run_training(train_cfg(max_steps=2, keep_runs=5), paths(inputs, out))
    first = (out / "final" / "model.safetensors").read_bytes()
    (run_a,) = [r for r, _ in ident.list_runs(out / "checkpoints")]
    other = make_inputs(tmp_path / "other", n_embd=48, seed=1)  # another architecture, same data
    for cfg, p in (
        (train_cfg(max_steps=2, keep_runs=5), paths(inputs, out, model=other["model"])),
        (train_cfg(max_steps=2, lr=0.02, keep_runs=5), paths(inputs, out)),
        (train_cfg(max_steps=1, keep_runs=5), paths(inputs, out)),  # fewer steps: another schedule
    ):
        run_training(cfg, p)
        meta = read_meta(out / "final").training
        assert meta["resumed_from"] is None and meta["steps_this_run"] == meta["steps"]
    runs = [r for r, _ in ident.list_runs(out / "checkpoints")]
    assert len(runs) == 4 and run_a in runs
    assert [c.step for c in ck.list_checkpoints(run_a)] == [2]  # untouched
    # the revert: the finished run is found, no step runs, the same bytes
    with caplog.at_level(logging.INFO, logger="distlm"):
        run_training(train_cfg(max_steps=2, keep_runs=5), paths(inputs, out))
    meta = read_meta(out / "final").training
    assert meta["steps_this_run"] == 0 and meta["resumed_from"] == str(run_a / "step-00000002")
    assert (out / "final" / "model.safetensors").read_bytes() == first
    # more steps extend the finished run (a documented exception): from step 2, one more step
    with caplog.at_level(logging.INFO, logger="distlm"):
        run_training(train_cfg(max_steps=3, keep_runs=3), paths(inputs, out))
    meta = read_meta(out / "final").training
    assert meta["steps_this_run"] == 1 and meta["resumed_from"] == str(run_a / "step-00000002")
    assert "extending the finished run" in caplog.text
    # keep_runs 3 kept the three most recently used (the extension's, run_a and max_steps 1's):
    # the model and lr edits' runs are gone
    runs = [r for r, _ in ident.list_runs(out / "checkpoints")]
    assert len(runs) == 3 and run_a in runs
    # resume: never starts this identity afresh and leaves the others alone
    run_training(train_cfg(max_steps=2, resume="never", keep_runs=3), paths(inputs, out))
    assert read_meta(out / "final").training["steps_this_run"] == 2
    assert len(ident.list_runs(out / "checkpoints")) == 3


def test_bad_inputs_are_refused(tmp_path):
    short = make_inputs(tmp_path / "short", block_size=32, n_positions=16)
    with pytest.raises(DistlmError, match="block size 32 is beyond the context"):
        run_training(train_cfg(), paths(short, tmp_path / "a"))
    ok = make_inputs(tmp_path / "ok")
    with pytest.raises(DistlmError, match="train.global_batch_size"):
        run_training(train_cfg(global_batch_size=6), paths(ok, tmp_path / "b"))


# ----------------------------------------------------------------------------- torchrun, 2 ranks


def _torchrun(
    cfg: TrainConfig, inputs, out: Path, *, restarts: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd, env = _torchrun_cmd(cfg, inputs, out, restarts=restarts, env=env)
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)


def _torchrun_cmd(
    cfg: TrainConfig, inputs, out: Path, *, restarts: int = 0, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The stage's torchrun command line (2 ranks, gloo) for `cfg`, and its environment."""
    cfg_path = out.parent / f"{out.name}.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    write_document(cfg_path, cfg)
    cmd = local_torchrun(  # the rule's command (distlm.launch.torchrun), 2 ranks
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
    return cmd, {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_two_ranks_loss_falls_and_kill_resume_is_bit_identical(inputs, tmp_path):
    cfg = train_cfg(profile={"enabled": True, "wait": 1, "warmup": 1, "active": 1})
    a = _torchrun(cfg, inputs, tmp_path / "a")
    assert a.returncode == 0, a.stderr[-4000:]
    # the same run, its last rank SIGKILLed after step 3 (checkpoint at 2) by a test fault the
    # harness hands to the ranks; torchrun restarts it
    faults = fault_env(tmp_path / "faults.json", kill_after_step=3)
    b = _torchrun(cfg, inputs, tmp_path / "b", restarts=1, env=faults)
    assert b.returncode == 0, b.stderr[-4000:]
    assert "killing rank 1" in (tmp_path / "b" / "logs" / "rank1.log").read_text()
    assert "resuming from" in (tmp_path / "b" / "logs" / "rank0.log").read_text()
    for rank in (
        0,
        1,
    ):  # each rank set glibc's malloc to keep what it frees (distlm.runtime.host)
        log = (tmp_path / "a" / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank}: glibc" in log and "keeps freed memory for reuse" in log

    wa = load_model_dir(tmp_path / "a" / "final").state_dict()
    wb = load_model_dir(tmp_path / "b" / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = [r.split(",") for r in (tmp_path / "a" / "metrics.csv").read_text().splitlines()[1:]]
    assert len(rows) == 6 and float(rows[-1][1]) < float(rows[0][1])  # the loss falls
    strip = lambda p: [",".join(r.split(",")[:6]) for r in p.read_text().splitlines()]
    assert strip(tmp_path / "a" / "metrics.csv") == strip(tmp_path / "b" / "metrics.csv")
    meta = read_meta(tmp_path / "b" / "final")
    assert meta.created_by == "train" and meta.training["restart_count"] == 1
    assert meta.training["resumed_from"].endswith("step-00000002")
    # a world of one is another run (topology): it trains in its own folder, the 2-rank one stays
    run_training(cfg, paths(inputs, tmp_path / "a"))
    assert len(ident.list_runs(tmp_path / "a" / "checkpoints")) == 2
    assert read_meta(tmp_path / "a" / "final").training["world_size"] == 1
    for r in (0, 1):
        line = (tmp_path / "a" / "logs" / f"rank{r}.log").read_text().splitlines()[0]
        assert f"[rank {r}]" in line and line[:4].isdigit()
        assert (tmp_path / "a" / "profile" / f"trace-rank{r}.json").stat().st_size > 0


def _torchrun_as_launched(cfg: TrainConfig, inputs, out: Path, notice: Path) -> subprocess.Popen:
    """The stage's torchrun with SIGUSR1 ignored, as distlm-launch's srun task execs it (the
    agent must not die of the time-limit warning), telling its StopNotice to `notice`."""
    from distlm.train.documents import STOP_NOTICE_ENV

    cmd, env = _torchrun_cmd(cfg, inputs, out, env={**os.environ})
    env[STOP_NOTICE_ENV] = str(notice)
    ignoring = "import os, signal, sys; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
    ignoring += "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    return subprocess.Popen(
        [sys.executable, "-c", ignoring, *cmd[1:]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _warn_ranks(pids: list[int]) -> None:
    """SIGUSR1 to each rank, as `scancel --signal=USR1` does: every process of the step."""
    import signal

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)


@pytest.mark.slow
def test_a_time_limit_warning_while_the_ranks_start_stops_them_at_the_first_step(inputs, tmp_path):
    """The launcher's SIGUSR1 reaches ranks still starting (here: importing torch). They inherit
    the torchrun agent's SIG_IGN (distlm-launch's srun task sets it), so the warning was
    dropped: the training ran on into the time limit, a stop the launcher does not requeue. The
    ranks latch it from their first line: they stop at their first step boundary with a
    checkpoint and the StopNotice that the launcher requeues on; the rerun resumes there."""
    from procs import children

    from distlm.core.documents import read_document
    from distlm.train.documents import StopNotice

    out, notice = tmp_path / "train", tmp_path / "stop.json"
    proc = _torchrun_as_launched(train_cfg(), inputs, out, notice)
    try:
        # each rank opens its log before it imports torch: both started, neither trains yet
        logs = [out / "logs" / f"rank{r}.log" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in logs):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.01)
        ranks = children(proc.pid)
        assert len(ranks) == 2, ranks
        _warn_ranks(ranks)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode != 0, output[-3000:]
    for log_file in logs:
        assert "came while this rank was starting" in log_file.read_text()
    assert "stopping at step 1 of 6 (SIGUSR1 on 2 of 2 ranks" in logs[0].read_text()
    stop = read_document(notice, StopNotice)
    assert (stop.step, stop.signals) == (1, ["SIGUSR1"])
    assert [c.step for c in ck.list_checkpoints(Path(stop.checkpoint_run))] == [1]
    rerun = _torchrun(train_cfg(), inputs, out)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert read_meta(out / "final").training["resumed_from"].endswith("step-00000001")


@pytest.mark.slow
def test_a_time_limit_warning_after_the_last_step_leaves_the_training_finished(inputs, tmp_path):
    """The warning (sent again every few seconds) reaches ranks that have written the final folder
    and are exiting. Python's exit puts a signal that has a Python handler back to its default
    action, which for SIGUSR1 is death: the ranks died of it (exit code -10), torchrun and the
    launcher failed a finished training without a StopNotice, the job was not requeued, and
    Snakemake removed its outputs (CI of stop 34). A rank whose work is done ignores it."""
    from procs import children

    out, notice = tmp_path / "train", tmp_path / "stop.json"
    proc = _torchrun_as_launched(train_cfg(), inputs, out, notice)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None:  # from the final folder on, a warning every 10 ms until the end
            assert time.monotonic() < deadline, "the training did not end"
            if (out / "final").is_dir():
                _warn_ranks(children(proc.pid))
            time.sleep(0.01)
        output = proc.stdout.read()
    finally:
        proc.kill()
    assert (out / "final").is_dir(), output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert not notice.exists()  # nothing stopped: the launcher does not requeue
    assert "stopping at step" not in (out / "logs" / "rank0.log").read_text()


# ----------------------------------------------------------------------------- workflow


def test_train_stage_in_tiny_workflow(workflow_run):
    res = workflow_run / "results" / "train"
    base = workflow_run / "results" / "model" / "base"
    final = res / "final"
    assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in base.iterdir())
    meta = read_meta(final)
    assert meta.created_by == "train" and meta.training["steps"] == 8
    assert meta.training["world_size"] == 2 and meta.arch_digest == read_meta(base).arch_digest
    load_model_dir(final)
    rows = (res / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,perplexity,grad_norm,lr") and len(rows) == 9
    assert len((res / "val.csv").read_text().splitlines()) == 3  # steps 4 and 8
    assert list((res / "tb").glob("events.out.tfevents.*"))
    prof = json.loads((res / "profile" / "profile.json").read_text())
    assert prof["enabled"] and prof["captured"]
    for r in (0, 1):
        assert (res / "profile" / f"trace-rank{r}.json").is_file()
        top = json.loads((res / "profile" / f"top-ops-rank{r}.json").read_text())
        assert top["ops"] and top["ops"][0]["self_cpu_us"] >= top["ops"][-1]["self_cpu_us"]
        assert f"[rank {r}]" in (workflow_run / "logs" / "train" / f"rank{r}.log").read_text()
    assert [c.step for c in ck.list_checkpoints(only_run(res))] == [4, 8]


def test_finished_work_is_reused(inputs, tmp_path, caplog):
    """A job killed after its last checkpoint (final/ missing), or forced: the rerun writes final/
    from that checkpoint, no step runs, the metrics history is kept."""
    out = tmp_path / "train"
    run_training(train_cfg(max_steps=2), paths(inputs, out))
    first = (out / "final" / "model.safetensors").read_bytes()
    assert read_meta(out / "final").training["steps_this_run"] == 2
    import shutil

    shutil.rmtree(out / "final")
    (out / "metrics.csv").unlink()  # Snakemake removes the declared outputs before the job
    with caplog.at_level(logging.INFO, logger="distlm"):
        run_training(train_cfg(max_steps=2), paths(inputs, out))
    meta = read_meta(out / "final").training
    assert meta["steps_this_run"] == 0 and meta["resumed_from"].endswith("step-00000002")
    assert "is this run's finished work" in caplog.text
    assert not [r for r in caplog.records if " loss " in r.getMessage()]  # no step, no eval
    assert (out / "final" / "model.safetensors").read_bytes() == first
    assert len((out / "metrics.csv").read_text().splitlines()) == 3  # history kept: 2 steps
    assert not (out / "checkpoints" / "trainer.lease.json").exists()  # released


def test_checkpoints_of_the_layout_before_run_folders_are_adopted(inputs, tmp_path, caplog):
    """An upgrade reuses the finished work of the old layout (checkpoints/step-*)."""
    out = tmp_path / "train"
    run_training(train_cfg(max_steps=2), paths(inputs, out))
    run = only_run(out)
    for c in ck.list_checkpoints(run):
        c.path.rename(out / "checkpoints" / c.path.name)
    (run / ident.IDENTITY).unlink()
    run.rmdir()
    (out / "checkpoints" / ident.LEGACY_REQUEST).write_text("{}")
    with caplog.at_level(logging.INFO, logger="distlm"):
        run_training(train_cfg(max_steps=2), paths(inputs, out))
    assert read_meta(out / "final").training["steps_this_run"] == 0
    assert "moved legacy checkpoint" in caplog.text
    assert not (out / "checkpoints" / ident.LEGACY_REQUEST).exists()


def test_a_stop_signal_checkpoints_at_the_step_boundary_and_the_rerun_resumes(
    inputs, tmp_path, monkeypatch
):
    """SIGUSR1 (or SIGTERM) mid-run: the ranks finish the step, write its checkpoint (step 3,
    between the periodic 2 and 4), stop with TrainingStopped; the rerun resumes from step 3 and
    ends bit-identical to an uninterrupted run."""
    import signal

    from distlm.train import trainer as trainer_mod

    ref = tmp_path / "ref"
    run_training(train_cfg(), paths(inputs, ref))
    real = trainer_mod.Trainer.train_step

    def step_then_signal(self):
        row = real(self)
        if self.step == 2:  # arrives during step 3's work: acted on at step 3's end
            os.kill(os.getpid(), signal.SIGUSR1)
        return row

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", step_then_signal)
    out = tmp_path / "train"
    with pytest.raises(trainer_mod.TrainingStopped, match=r"stopping at step 3 of 6 \(SIGUSR1"):
        run_training(train_cfg(), paths(inputs, out))
    assert [c.step for c in ck.list_checkpoints(only_run(out))] == [2, 3]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", real)
    run_training(train_cfg(), paths(inputs, out))
    assert read_meta(out / "final").training["resumed_from"].endswith("step-00000003")
    assert (out / "final" / "model.safetensors").read_bytes() == (
        ref / "final" / "model.safetensors"
    ).read_bytes()


def test_a_warning_latched_before_the_loop_stops_it_at_the_first_step(
    inputs, tmp_path, monkeypatch
):
    """A SIGUSR1 latched while the rank was starting (distlm.runtime.stop_latch): the loop stops at its
    first step boundary with a checkpoint, as for a warning during the loop."""
    import signal

    from distlm.runtime import stop_latch
    from distlm.train import trainer as trainer_mod

    monkeypatch.setattr(stop_latch, "_warned", False)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        stop_latch.latch()
        os.kill(os.getpid(), signal.SIGUSR1)
        out = tmp_path / "train"
        with pytest.raises(trainer_mod.TrainingStopped, match=r"stopping at step 1 of 6 \(SIGUSR1"):
            run_training(train_cfg(), paths(inputs, out))
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert [c.step for c in ck.list_checkpoints(only_run(out))] == [1]


def test_prune_counts_only_verified_checkpoints(tmp_path):
    for s in (2, 4, 6):
        _save(tmp_path, s)
    w = tmp_path / "step-00000006" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:20])  # the newest is corrupt
    _save(tmp_path, 8, keep=2)
    # good ones: 8 and 4 are kept; 6 (corrupt, newer than 4) stays until it is older; 2 goes
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [4, 6, 8]
    _save(tmp_path, 10, keep=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [8, 10]


def test_a_checkpoint_that_fails_its_read_back_prunes_nothing(tmp_path, monkeypatch):
    for s in (2, 4):
        _save(tmp_path, s, keep=2)
    real = ck._verify

    def bad_disk(c):  # step 6's bytes on disk differ from what was written
        if c.step == 6:
            raise DistlmError(f"{c.path / 'model.safetensors'}: sha256 differs (simulated)")
        real(c)

    monkeypatch.setattr(ck, "_verify", bad_disk)
    with pytest.raises(DistlmError, match="simulated"):
        _save(tmp_path, 6, keep=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [2, 4, 6]  # nothing pruned


def test_leftovers_of_dead_writers_go_at_the_next_start(tmp_path):
    from distlm.core import io

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    me = f"{io._HOST}-{os.getpid()}"
    gone = f"{io._HOST}-{int(dead.stdout)}"
    (tmp_path / f".step-00000012.{gone}.abc.tmp").mkdir()  # a killed checkpoint write
    (tmp_path / f".final.old-{gone}").mkdir()  # killed between the two renames
    (tmp_path / f".metrics.csv.{gone}.xyz.tmp").write_text("partial")
    (tmp_path / f".step-00000014.{me}.abc.tmp").mkdir()  # a live writer (this process)
    (tmp_path / f".step-00000016.otherhost-{os.getpid()}.abc.tmp").mkdir()  # cannot be asked
    (tmp_path / ".hidden").write_text("not ours")
    removed = sorted(p.name for p in io.remove_leftovers(tmp_path))
    assert removed == sorted(
        [f".step-00000012.{gone}.abc.tmp", f".final.old-{gone}", f".metrics.csv.{gone}.xyz.tmp"]
    )
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            ".hidden",
            f".step-00000014.{me}.abc.tmp",
            f".step-00000016.otherhost-{os.getpid()}.abc.tmp",
        ]
    )
    # another host's leftover goes once nothing in it changed for STALE_AFTER_S
    old = time.time() - io.STALE_AFTER_S - 60
    os.utime(tmp_path / f".step-00000016.otherhost-{os.getpid()}.abc.tmp", (old, old))
    assert [p.name for p in io.remove_leftovers(tmp_path)] == [
        f".step-00000016.otherhost-{os.getpid()}.abc.tmp"
    ]


def test_every_file_of_an_atomic_folder_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    from distlm.core import io

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", str(a)))
        return real_replace(a, b)

    monkeypatch.setattr(io.os, "fsync", fsync)
    monkeypatch.setattr(io.os, "replace", replace)
    with io.atomic_dir(tmp_path / "ck") as tmp:
        (tmp / "sub").mkdir()
        torch.save({"a": 1}, tmp / "optimizer.pt")  # written outside distlm.core.io
        (tmp / "sub" / "x.bin").write_bytes(b"x")
    rename_at = events.index(("rename", str(tmp)))
    synced = {path for kind, path in events[:rename_at] if kind == "fsync"}
    assert {
        str(tmp / "optimizer.pt"),
        str(tmp / "sub" / "x.bin"),
        str(tmp / "sub"),
        str(tmp),
    } <= synced


def test_tensorboard_folder_removed_under_the_run_is_rebuilt(tmp_path, caplog):
    """Snakemake removes the outputs of a job it thinks incomplete, e.g. when rerun after being
    killed while this job trains on: the run goes on, tb/ comes back with every row."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from distlm.train.metrics import Metrics

    tb = tmp_path / "tb"
    m = Metrics(enabled=True, metrics_csv=tmp_path / "m.csv", val_csv=tmp_path / "v.csv", tb_dir=tb)
    row = lambda s: {
        "step": s, "loss": 1.0, "perplexity": 2.7, "grad_norm": 1.0, "lr": 0.1, "tokens": s,
        "tokens_per_s": 1.0, "step_time_s": 0.1,
    }  # fmt: skip
    m.log_step(row(1))
    m.flush()
    shutil.rmtree(tb)
    (tmp_path / "m.csv").unlink()
    with caplog.at_level(logging.WARNING, logger="distlm"):
        for s in (2, 3):
            m.log_step(row(s))
        m.flush()
    m.close()
    assert "rebuilding the folder from the metric history" in caplog.text
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 4
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def test_fused_adamw_available_tells_what_torch_runs():
    """CPU torch >= 2.4 has the fused AdamW kernel; the meta device is outside torch.optim's
    fused devices, so AdamW(fused=True) refuses it and the answer is False."""
    assert fused_adamw_available(torch.device("cpu")) is True
    assert fused_adamw_available(torch.device("meta")) is False
    p = torch.zeros(1, device="meta", requires_grad=True)
    p.grad = torch.ones(1, device="meta")
    with pytest.raises(RuntimeError, match="fused"):
        torch.optim.AdamW([p], fused=True).step()


def test_fused_adamw_is_not_claimed_where_torch_has_no_kernel(monkeypatch):
    """A torch whose CPU build lacks the kernel (as before 2.4) answers with the dispatcher's
    NotImplementedError on the first fused step: the trainer then steps the unfused AdamW."""
    real = torch.optim.AdamW

    class NoFusedKernel(real):
        def step(self, closure=None):
            if self.defaults.get("fused"):
                raise NotImplementedError(
                    "Could not run 'aten::_fused_adamw_' with arguments from the 'CPU' backend."
                )
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", NoFusedKernel)
    fused_adamw_available.cache_clear()
    try:
        assert fused_adamw_available(torch.device("cpu")) is False
    finally:
        fused_adamw_available.cache_clear()


def test_test_faults_are_armed_once_and_only_where_they_act(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kill, spec = faults_mod.FaultSpec(kill_after_step=3), faults_mod.FaultSpec
    # no fault asked for: nothing for the step loop to call
    assert faults_mod.REQUESTED is None
    assert faults_mod.arm(rank=1, world_size=2) is None
    assert faults_mod.arm(rank=1, world_size=2, spec=spec()) is None
    # the kill acts on the last rank of the first attempt only
    assert faults_mod.arm(rank=0, world_size=2, spec=kill) is None
    armed = faults_mod.arm(rank=1, world_size=2, spec=kill)
    assert armed is not None and armed.kill_after_step == 3
    armed.after_step(2, rank=1)  # not its step: returns
    inject(monkeypatch, kill_after_step=3)  # what the harness asks for is what arm reads
    assert faults_mod.arm(rank=1, world_size=2) == armed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults_mod.arm(rank=1, world_size=2, spec=kill) is None
    # the NaN acts on every rank, at its step only
    nan = faults_mod.arm(rank=0, world_size=2, spec=spec(nan_at_step=2))
    assert nan is not None and nan.kill_after_step is None
    loss = torch.tensor(1.5)
    assert nan.loss(1, loss) is loss
    assert torch.isnan(nan.loss(2, loss))


# ----------------------------------------------------------------------------- checkpoint documents


def _rewrite(c: ck.Checkpoint, name: str, edit) -> None:
    """Change one file of a checkpoint and re-seal it in checkpoint.json (its hash matches)."""
    from distlm.core.io import sha256_file

    p = c.path / name
    obj = json.loads(p.read_text())
    edit(obj)
    p.write_text(json.dumps(obj))
    index = json.loads((c.path / "checkpoint.json").read_text())
    index["sha256"][name] = sha256_file(p)
    (c.path / "checkpoint.json").write_text(json.dumps(index))
    ck._VERIFIED.clear()


def test_checkpoint_documents_of_the_release_before_still_resume(tmp_path):
    """state.json before it carried its format tag (what the release before wrote, under the same
    distlm-checkpoint/1 index) reads as version 1: an upgrade resumes its checkpoints."""
    _save(tmp_path, 2)
    (c,) = ck.list_checkpoints(tmp_path)
    index = json.loads((c.path / "checkpoint.json").read_text())
    assert index["format"] == "distlm-checkpoint/1"  # the index's tag is unchanged
    assert json.loads((c.path / "state.json").read_text())["format"] == "distlm-checkpoint-state/1"
    _rewrite(c, "state.json", lambda s: s.pop("format"))
    ck.verify(c)
    assert ck.read_state(c) == checkpoint_state(2)


@pytest.mark.parametrize(
    "name, tag, error",
    [
        ("state.json", "distlm-checkpoint-state/9", r"state.json: a 'distlm-checkpoint-state/9'"),
        ("checkpoint.json", "distlm-checkpoint/9", r"checkpoint.json: a 'distlm-checkpoint/9'"),
    ],
)
def test_checkpoint_documents_of_an_unknown_version_are_refused(tmp_path, caplog, name, tag, error):
    _save(tmp_path, 2)
    (c,) = ck.list_checkpoints(tmp_path)
    if name == "state.json":
        _rewrite(c, name, lambda s: s.__setitem__("format", tag))
        with pytest.raises(DistlmError, match=error) as e:
            ck.read_state(c)
        assert "another version of distlm" in str(e.value)
        assert f"Remove {tmp_path} (or set train.resume: never)" in str(e.value)
    else:  # the index: the checkpoint does not verify, so a start skips it, naming it
        index = json.loads((c.path / name).read_text())
        (c.path / name).write_text(json.dumps({**index, "format": tag}))
        ck._VERIFIED.clear()
        with caplog.at_level(logging.WARNING, logger="distlm"):
            assert ck.latest_good(tmp_path) is None
        assert re.search(error, caplog.text)


# identity.json as distlm wrote it before the file carried its format tag (the run identity's
# fields, untagged), in the run folder its digest names: an upgrade must find that run again.
LEGACY_IDENTITY = {
    "model": {"arch_digest": "a" * 64, "base_model_sha256": "b" * 64},
    "data": {"config_digest": "c" * 64, "block_size": 32, "train_blocks": 64, "seed": 0},
    "topology": {"world_size": 1, "micro_batch": 4, "grad_accum": 1, "global_batch": 4},
    "optim": {
        "lr": 0.1,
        "min_lr": 0,
        "warmup_steps": 2,
        "max_steps": 10,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "grad_clip": 1.0,
        "precision": "fp32",
    },
}


def test_a_run_folder_of_the_release_before_is_found_again(tmp_path):
    """identity.json without its format tag reads as version 1, and its run id (the folder's
    name, a digest of the fields) is what the typed identity computes: the run is reused."""
    legacy = tmp_path / digest(LEGACY_IDENTITY)[:16]
    legacy.mkdir()
    (legacy / ident.IDENTITY).write_text(json.dumps(LEGACY_IDENTITY, indent=2) + "\n")
    read = ident.read_identity(legacy / ident.IDENTITY)
    assert read == run_identity() and read.fields() == LEGACY_IDENTITY
    assert ident.open_run(tmp_path, run_identity()) == legacy
    assert ident.list_runs(tmp_path) == [(legacy, run_identity())]
    # a new run folder's identity.json is the tagged document
    other = ident.open_run(tmp_path, run_identity(lr=0.2))
    written = json.loads((other / ident.IDENTITY).read_text())
    assert written == {"format": "distlm-run-identity/1", **run_identity(lr=0.2).fields()}


@pytest.mark.parametrize(
    "content, error",
    [
        (None, r"RunIdentity not found: .*/identity.json"),
        ("{", r"/identity.json: malformed RunIdentity: not valid JSON"),
        ({"format": "distlm-run-identity/9"}, r"/identity.json: a 'distlm-run-identity/9'"),
        ({"format": "distlm-model/1"}, r"/identity.json: a 'distlm-model/1' document"),
        ({**LEGACY_IDENTITY, "optim": {"lr": 0.1}}, r"/identity.json: malformed .* optim.min_lr"),
    ],
)
def test_a_wrong_identity_file_is_refused_naming_it(tmp_path, content, error):
    path = tmp_path / "run" / ident.IDENTITY
    path.parent.mkdir()
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(DistlmError, match=error):
        ident.read_identity(path)


def test_a_malformed_checkpoint_state_names_the_field(tmp_path):
    _save(tmp_path, 2)
    (c,) = ck.list_checkpoints(tmp_path)
    _rewrite(c, "state.json", lambda s: s.pop("identity"))
    with pytest.raises(DistlmError, match=r"state.json: malformed CheckpointState: field identity"):
        ck.read_state(c)


_FAULTS = """
import resource, statistics, sys, torch
from distlm.runtime.host import keep_freed_memory
from distlm.core.log import setup_logging

setup_logging()
if sys.argv[1] == "keep":
    assert keep_freed_memory("test")
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # the heap grows to its size first
    x = torch.ones(10_000_000); del x  # 40 MB: above the largest block glibc keeps by default
per_tensor = []
for _ in range(20):
    before = faults()
    x = torch.ones(10_000_000); del x
    per_tensor.append(faults() - before)
# the median: in some runs small allocations made between two tensors still push the next one
# above them once or twice (fresh pages) before the heap settles
print(int(statistics.median(per_tensor)))
"""


def test_a_training_rank_keeps_freed_memory_instead_of_faulting_it_in_again():
    """keep_freed_memory (each training rank calls it, in run_training): a tensor freed and made
    again reuses the same memory, with no page faults; with glibc's defaults a 40 MB one is
    unmapped on free and each of its 9,766 pages faulted in again."""

    def faults_per_tensor(mode: str) -> tuple[int, str]:
        r = subprocess.run(
            [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout), r.stderr

    kept, log = faults_per_tensor("keep")
    default, _ = faults_per_tensor("default")
    assert kept < 100 and default > 5000, (kept, default)
    assert "test: glibc" in log and "keeps freed memory for reuse" in log


def test_keep_freed_memory_says_when_the_c_library_is_not_glibc(monkeypatch, caplog):
    import platform

    from distlm.runtime.host import keep_freed_memory

    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    with caplog.at_level(logging.INFO, logger="distlm"):
        assert keep_freed_memory("rank 3") is False
    assert "rank 3: the C library is not glibc" in caplog.text


@pytest.mark.parametrize("clip", [0.05, 1.0, 1e4, float("inf")])
def test_clipping_is_clip_grad_norm_s_to_the_bit(clip):
    """The layout's grad_norm and clip_gradients (the training step's) leave every gradient as
    torch.nn.utils.clip_grad_norm_ does, bit for bit, whether the norm is above the clip (scaled)
    or below it (multiplied by 1), without reading the norm on the host."""
    from distlm.runtime.dist import Topology
    from distlm.settings.layout_rules import Replicated
    from distlm.train.optim import clip_gradients
    from distlm.train.parallel import ReplicatedLayout

    grad_norm = ReplicatedLayout(Topology.single(), Replicated()).grad_norm

    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    ref.load_state_dict(ours.state_dict())
    for a, b in zip(ours.parameters(), ref.parameters()):
        a.grad = torch.randn_like(a) * 0.01
        b.grad = a.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, foreach=True)
    norm = grad_norm(ours)
    assert torch.equal(norm, want)
    clip_gradients(ours, clip, norm)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters()))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_a_step_with_a_non_finite_norm_leaves_weights_and_optimizer_alone(fused):
    """step_unless_nonfinite (the training step's): a finite norm steps as AdamW.step does, to
    the bit; a non-finite one leaves the weights and the whole optimizer state (moments, step
    count) as they were, so the next finite step is the one the skipped step never touched."""
    from distlm.train.optim import step_unless_nonfinite

    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def run(nan_at: int | None, with_guard: bool) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(40, 30))
        opt = torch.optim.AdamW([w], lr=1e-2, fused=fused)
        for i in range(4):
            w.grad = torch.randn(40, 30, generator=torch.Generator().manual_seed(i))
            if i == nan_at:
                w.grad[3, 4] = float("nan")
            norm = torch.nn.utils.get_total_norm([w.grad])
            if with_guard:
                step_unless_nonfinite(opt, scaler, norm)
            elif i != nan_at:
                opt.step()
        return w.detach(), opt.state[w]

    plain, plain_state = run(None, with_guard=False)
    guarded, guarded_state = run(None, with_guard=True)
    assert torch.equal(plain, guarded)
    assert all(torch.equal(plain_state[k], guarded_state[k]) for k in plain_state)
    left_out, left_out_state = run(2, with_guard=False)  # step 2 never taken
    skipped, skipped_state = run(2, with_guard=True)
    assert torch.isfinite(skipped).all() and torch.equal(skipped, left_out)
    assert all(torch.equal(left_out_state[k], skipped_state[k]) for k in left_out_state)
    assert int(skipped_state["step"]) == 3


def test_train_state_saves_and_loads_what_a_whole_checkpoint_holds(inputs):
    """TrainState (what checkpoint.save writes and a resume loads) is torch.distributed.checkpoint's
    Stateful: its state_dict is a whole checkpoint's two tensor files (transformers' names), which
    load_state_dict puts back into another run's model and AdamW, bit for bit; its state.json
    gives the schedule and the scaler back."""
    from torch.distributed.checkpoint.stateful import Stateful

    from distlm.runtime.dist import Topology
    from distlm.settings.layout_rules import Replicated
    from distlm.train.checkpoint_writer import host_copy
    from distlm.train.optim import make_optimizer
    from distlm.train.parallel import ReplicatedLayout
    from distlm.train.state import TrainState

    t = train_cfg().train
    hw = DeviceBackend.cpu()
    sampler = StepSampler(64, BatchPlan(4, 1, 1), 0, seed=0)

    def state() -> TrainState:
        model = load_model_dir(inputs["model"])
        optimizer, scheduler = make_optimizer(model, t, torch.device("cpu"), "fp32")
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        layout = ReplicatedLayout(Topology.single(hw), Replicated())
        return TrainState(model, optimizer, scheduler, scaler, sampler, layout)

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(map(same, x, y))
        return x == y

    a, b = state(), state()
    assert isinstance(a, Stateful) and a.layout.checkpoints.name == ck.WHOLE
    for _ in range(3):
        a.model(torch.randint(0, 256, (2, 8))).float().square().mean().backward()
        a.optimizer.step()
        a.scheduler.step()
    saved = host_copy(a.state_dict())
    assert set(saved) == {"model", "optim"} and "transformer.wte.weight" in saved["model"]
    b.load_state_dict(saved)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert same(b.state_dict()["optim"], saved["optim"])
    doc = a.checkpoint_state(3, identity=run_identity(), history={})
    assert doc.data["samples_consumed"] == 12 and doc.scaler == {}
    b.load_checkpoint_state(doc)
    assert b.scheduler.state_dict() == a.scheduler.state_dict()


def test_background_checkpoints_write_what_the_loop_writes(inputs, tmp_path, monkeypatch):
    """The GPU's checkpoint policy run on the CPU (rank 0 copies the checkpoint to host memory,
    a thread writes it while training goes on): every checkpoint holds the weights of its own
    step, bit for bit those written in the loop; the final weights are the same; the run waits
    for the last write; each save's stall is in the training record."""
    import dataclasses

    from distlm.runtime.device import DeviceBackend

    a, b = tmp_path / "a", tmp_path / "b"
    run_training(train_cfg(), paths(inputs, a))
    in_loop = DeviceBackend.for_rank

    def background(cls, *args, **kw):
        return dataclasses.replace(in_loop(*args, **kw), background_checkpoints=True)

    monkeypatch.setattr(DeviceBackend, "for_rank", classmethod(background))
    run_training(train_cfg(), paths(inputs, b))
    ca, cb = ck.list_checkpoints(only_run(a)), ck.list_checkpoints(only_run(b))
    assert [c.step for c in ca] == [c.step for c in cb] == [4, 6]  # keep_last 2
    for x, y in zip(ca, cb, strict=True):
        wx, wy = ck.load_weights(x), ck.load_weights(y)
        assert all(torch.equal(wx[k], wy[k]) for k in wx)
        ox = ck.load_optimizer_state(x, torch.device("cpu"))["state"]
        oy = ck.load_optimizer_state(y, torch.device("cpu"))["state"]
        assert all(torch.equal(ox[i]["exp_avg"], oy[i]["exp_avg"]) for i in ox)
    fa, fb = (load_model_dir(d / "final").state_dict() for d in (a, b))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    stalls = read_meta(b / "final").training["checkpoint_stall_s"]
    assert len(stalls) == 3 and all(s >= 0 for s in stalls)


def test_a_save_that_waits_for_the_previous_write_says_so(inputs, tmp_path, monkeypatch, caplog):
    """Background checkpoints whose writes take longer than the steps between saves: each save
    that waited for the previous write says so in the log with the seconds waited, and the
    training record holds each write's own seconds apart from the loop's stalls."""
    import dataclasses
    import logging
    import time

    from distlm.runtime.device import DeviceBackend

    in_loop, write = DeviceBackend.for_rank, ck.write

    def background(cls, *args, **kw):
        return dataclasses.replace(in_loop(*args, **kw), background_checkpoints=True)

    def slow_write(*args, **kw):
        time.sleep(0.5)  # a disk slower than the steps
        return write(*args, **kw)

    monkeypatch.setattr(DeviceBackend, "for_rank", classmethod(background))
    monkeypatch.setattr(ck, "write", slow_write)
    with caplog.at_level(logging.INFO, logger="distlm"):
        run_training(train_cfg(), paths(inputs, tmp_path))
    waits = [r.getMessage() for r in caplog.records if "previous one's write" in r.getMessage()]
    assert waits and all("train.ckpt_every" in w for w in waits), waits
    waited = [float(w.split("waited ")[1].split(" s")[0]) for w in waits]
    assert all(0.1 < x < 1.0 for x in waited), waits
    training = read_meta(tmp_path / "final").training
    assert len(training["checkpoint_write_s"]) == len(training["checkpoint_stall_s"]) == 3
    assert all(w >= 0.5 for w in training["checkpoint_write_s"])
    assert training["startup_cpu_s"] > 0


def test_staged_copies_are_kept_from_save_to_save_and_wait_for_the_last_write():
    """A background write reads host copies (`CheckpointWriter.stage`) in buffers the writer
    keeps: the next save copies into the same buffers, and only once the write in flight is done
    with them; each write reads the values of its own save, whatever the loop changed since."""
    import threading

    writer = CheckpointWriter(background=True)
    tree = {
        "w": torch.arange(4.0),
        "opt": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]},
    }
    first, ready = writer.stage(tree)
    assert ready is None  # not pinned: the copies are done
    gate, read = threading.Event(), []

    def write(copy):
        assert gate.wait(10)
        read.append(copy["w"].clone())

    assert writer.submit(write, first) is None
    tree["w"] += 10  # the loop goes on
    threading.Timer(0.2, gate.set).start()
    second, _ = writer.stage(tree)  # waits for the write in flight
    assert read and torch.equal(read[0], torch.arange(4.0))
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.equal(second["w"], torch.arange(4.0) + 10)
    assert torch.equal(second["opt"]["state"][0]["exp_avg"], torch.ones(3))
    assert second["opt"]["param_groups"] == [{"lr": 0.1}]
    writer.close()


def test_staging_buffers_reserved_ahead_are_the_ones_a_save_copies_into():
    """`reserve` allocates the buffers in the background thread (the first save then stalls no
    longer than the next); `stage` copies into exactly those."""
    writer = CheckpointWriter(background=True)
    tree = ({"w": torch.arange(6.0).reshape(2, 3)}, {"state": {0: {"step": torch.tensor(2.0)}}})
    writer.reserve(tree)
    writer.wait()
    reserved = {k: v.data_ptr() for k, v in writer._buffers.items()}
    assert set(reserved) == {(0, "w"), (1, "state", 0, "step")}
    copy, _ = writer.stage(tree)
    assert copy[0]["w"].data_ptr() == reserved[(0, "w")]
    assert torch.equal(copy[0]["w"], tree[0]["w"]) and copy[1]["state"][0]["step"].item() == 2.0
    writer.reserve(tree)  # once: the buffers exist
    assert writer._pending is None
    writer.close()


def test_a_background_write_that_fails_is_raised_at_the_next_wait(tmp_path):
    """A background write's error (here a run folder that is a file) is not lost: the next
    save or the end of the run raises it."""
    writer = CheckpointWriter(background=True)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    def write(where):
        (where / "x").write_text("")

    assert writer.submit(write, blocker) is None
    with pytest.raises(OSError):
        writer.wait()
    writer.close()


@pytest.mark.slow
@pytest.mark.with_slurm  # a minute of compiling: in the session that mostly waits on SLURM
def test_compile_compiles_the_step_once_and_keeps_its_cache_with_the_run(inputs, tmp_path, caplog):
    """train.compile: the training step's graph is compiled once; validation runs the same
    module eagerly, so it compiles nothing (on an H100 the eval graph's compile took as long
    as the first); torch.compile's caches are kept in the stage's compile-cache folder, and a
    later process of the stage (a resumed or requeued run) loads its graphs from there instead
    of compiling them again, and says so."""
    import os

    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "train"
    env = {
        k: os.environ.pop(k)
        for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
        if k in os.environ
    }
    try:
        run_training(
            train_cfg(max_steps=3, eval_every=1, ckpt_every=3, compile=True),
            paths(inputs, out),
        )
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(out))
    finally:
        for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            os.environ.pop(k, None)
        os.environ.update(env)
    frames = torch._dynamo.utils.counters["frames"]
    # the loss module's forward (and what its graph breaks leave), compiled for the training
    # step; three validations and three steps later no frame was compiled again
    assert 0 < frames["ok"] == frames["total"] <= 4, dict(frames)
    cache = TrainPaths(**paths(inputs, out).__dict__).compile_cache / "inductor"
    assert cache.is_dir() and any(cache.rglob("*")), cache
    assert read_meta(out / "final").training["steps"] == 3
    inductor = torch._dynamo.utils.counters["inductor"]
    assert inductor["fxgraph_cache_miss"] > 0 and inductor["fxgraph_cache_hit"] == 0

    # the next process of the stage (here: two more steps, a run of its own) starts with no
    # compiled frame in memory and finds every graph in the stage's cache
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with caplog.at_level(logging.INFO, logger="distlm.train.trainer"):
            run_training(
                train_cfg(max_steps=5, eval_every=5, ckpt_every=5, compile=True),
                paths(inputs, out),
            )
    finally:
        for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            os.environ.pop(k, None)
        os.environ.update(env)
    inductor = torch._dynamo.utils.counters["inductor"]
    assert inductor["fxgraph_cache_hit"] > 0 and inductor["fxgraph_cache_miss"] == 0, inductor
    first = next(
        r.getMessage() for r in caplog.records if "the first of this process" in r.getMessage()
    )
    assert f"{inductor['fxgraph_cache_hit']} graph(s) from the compile cache, 0 compiled" in first
