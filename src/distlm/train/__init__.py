"""The training stage (DDP or FSDP2): sampler, trainer, parallel layouts, checkpoints, metrics and
profiling.

from distlm.train import TrainPaths, run_training
run_training(cfg, TrainPaths(tokens=..., model=..., tokenizer=..., out=Path("results/train")))

Modules, by what a change touches:
    trainer.py     `Trainer`: construction (the set-up phases in order), the step, validation,
                   the step loop; `run_training`
    setup.py       the set-up phases as functions: lease, data, the base model's args, DDP's
                   initial weight sync
    paths.py       `TrainPaths`: the stage's inputs and outputs, named as distlm.dag.stages declares
    optim.py       learning-rate schedule (`lr_at`), precision, AdamW (parameter groups, fused)
    parallel.py    the parallel layout (`layout_for`: DDP or FSDP2 shards): all that differs between
                   them, from building the model to its checkpoints; the loss module
    step_sampler.py the batch plan and each rank's blocks per step (exact resume)
    kernels.py     the fused LM-head cross-entropy and GELU
    resume.py      which checkpoint a start resumes or extends, loading it
    state.py       `TrainState`: the model, AdamW, schedule, scaler, data position and layout a
                   checkpoint saves and a resume loads (torch.distributed.checkpoint's Stateful);
                   AdamW's state by transformers' names (a whole checkpoint's optimizer.pt)
    identity.py    the run identity (identity.json) and its run folders: open, list, extend,
                   keep the most recently used
    checkpoint_save.py  the one save path: whole (rank 0's files) or sharded (every rank's),
                   every rank agreeing on each part's outcome
    checkpoint.py  the format of a run folder's checkpoints: write, verify, list, prune, read
    checkpoint_writer.py  the background writer (host copies, a thread, DCP's async saves)
    pushes.py      each checkpoint into a server that follows the run (`Pusher`)
    outputs.py     the metrics files' writes and the final model folder
    stopping.py    divergence, and the signals that stop at a step boundary with a checkpoint
    metrics.py     metrics.csv, val.csv and TensorBoard; profiling.py: the step profiler
    faults.py      test faults (NaN loss, kill after a step), off unless a test arms them
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names

if TYPE_CHECKING:
    from distlm.train.trainer import Trainer, TrainingDiverged, TrainPaths, lr_at, run_training

# Imported when first asked for (PEP 562), so that a light module of this package (its documents)
# can be imported without the rest: the report and distlm-launch read documents, and must not
# import torch for them.
_WHERE = {
    "TrainPaths": "distlm.train.trainer",
    "Trainer": "distlm.train.trainer",
    "TrainingDiverged": "distlm.train.trainer",
    "lr_at": "distlm.train.trainer",
    "run_training": "distlm.train.trainer",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = ["TrainPaths", "Trainer", "TrainingDiverged", "lr_at", "run_training"]
