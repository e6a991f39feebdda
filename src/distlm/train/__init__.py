"""The DDP training stage: sampler, trainer, checkpoints, metrics and profiling.

from distlm.train import TrainPaths, run_training
run_training(cfg, TrainPaths(tokens=..., model=..., tokenizer=..., out=Path("results/train")))
"""

from distlm.train.trainer import Trainer, TrainingDiverged, TrainPaths, lr_at, run_training

__all__ = ["TrainPaths", "Trainer", "TrainingDiverged", "lr_at", "run_training"]
