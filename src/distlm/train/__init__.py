"""The DDP training stage: sampler, trainer, checkpoints, metrics and profiling.

from distlm.train import TrainPaths, run_training
run_training(cfg, TrainPaths(tokens=..., model=..., tokenizer=..., out=Path("results/train")))

Modules, by what a change touches:
    trainer.py     `Trainer`: construction (the set-up phases in order), the step, validation,
                   the step loop; `run_training`
    setup.py       the set-up phases as functions: lease, data, model, initial weight sync
    paths.py       `TrainPaths`: the stage's inputs and outputs, named as distlm.stages declares
    optim.py       learning-rate schedule (`lr_at`), precision, AdamW (parameter groups, fused)
    parallel.py    `Replicas`: how the ranks hold the model (DDP, or FSDP2 shards), the loss module
    step_sampler.py the batch plan and each rank's blocks per step (exact resume)
    kernels.py     the fused LM-head cross-entropy and GELU
    resume.py      which checkpoint a start resumes or extends, loading it
    state.py       `TrainState`: the model, AdamW, schedule, scaler and data position a
                   checkpoint saves and a resume loads (torch.distributed.checkpoint's Stateful)
    identity.py    the run identity (identity.json) and its run folders: open, list, extend,
                   keep the most recently used
    checkpoint.py  the checkpoints of a run folder: the one save path, verify, list, prune, load
    outputs.py     the metrics files' writes and the final model folder
    stopping.py    divergence, and the signals that stop at a step boundary with a checkpoint
    metrics.py     metrics.csv, val.csv and TensorBoard; profiling.py: the step profiler
    faults.py      test faults (NaN loss, kill after a step), off unless a test arms them
"""

from distlm.train.trainer import Trainer, TrainingDiverged, TrainPaths, lr_at, run_training

__all__ = ["TrainPaths", "Trainer", "TrainingDiverged", "lr_at", "run_training"]
