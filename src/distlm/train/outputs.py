"""What a training run writes beside its checkpoints (distlm.train.checkpoint): the metrics
files, and at the end the final model folder with the training record in its metadata. The
`Trainer`'s `save_checkpoint` and `write_final` call these."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from distlm.core.log import get_logger
from distlm.data.documents import TokenMeta
from distlm.model import DTYPES, write_model_dir
from distlm.model.documents import ModelMeta
from distlm.settings.train import TrainConfig
from distlm.train.metrics import Metrics
from distlm.train.paths import TrainPaths

log = get_logger(__name__)


def metrics_io(call: Callable[[], object]) -> None:
    """Write the metrics files, which are derived: the checkpoint holds their history and the
    next start writes them again. So a failure here (Snakemake removing a stopped job's
    outputs under it, a full disk) is logged and never costs the checkpoint or hides why the
    run stopped."""
    try:
        call()
    except OSError as e:
        log.warning("metrics files not written (%s); the next start writes them again", e)


def write_final(
    paths: TrainPaths,
    cfg: TrainConfig,
    *,
    tensors: dict[str, torch.Tensor],
    base_meta: ModelMeta,
    data_meta: TokenMeta,
    metrics: Metrics,
    run: dict,
    resumed_from: str | None,
    steps_run: int,
    wall_s: float,
) -> ModelMeta:
    """Rank 0 writes the final model folder, in the layout of the serialized base model
    (atomically: every file fsynced, then the folder renamed into place): `tensors`, the whole
    model in transformers' names, and config.json the base's. `run`: the run's shape (steps,
    tokens, world size, batch, block size, precision, device, backend)."""
    dtype_name = base_meta.dtype
    sd = {k: v.detach().to("cpu", DTYPES[dtype_name]).contiguous() for k, v in tensors.items()}
    last = metrics.train_rows[-1] if metrics.train_rows else {}
    lastval = metrics.val_rows[-1] if metrics.val_rows else {}
    training = {
        **run,
        "train_loss": last.get("loss"),
        "val_loss": lastval.get("val_loss"),
        "val_perplexity": lastval.get("val_perplexity"),
        "resumed_from": resumed_from,
        "steps_this_run": steps_run,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "wall_s": wall_s,
        "settings": cfg.train.model_dump(exclude={"profile"}),
    }
    return write_model_dir(
        paths.final,
        state_dict=sd,
        config_from=paths.model,
        tokenizer_dir=paths.tokenizer,
        meta={
            "created_by": "train",
            "source": {
                "kind": "train",
                "base_model": str(paths.model),
                "base_model_sha256": base_meta.model_sha256,
            },
            "config_digest": cfg.digest,
            "data_config_digest": data_meta.config_digest,
            "dtype": dtype_name,
            "training": training,
        },
    )
