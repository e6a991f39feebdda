"""The training stage's entry point (DDP or FSDP2), started by torchrun (workflow/rules/train.smk):

    torchrun --standalone --nproc-per-node=2 --max-restarts=0 -m distlm.entry.train \\
        --config results/config/train.json --tokens results/data/tokens.h5 \\
        --tokenizer results/data/tokenizer --model results/model/base --out results/train \\
        --rank-log 'logs/train/rank{rank}.log'

All logic is in distlm.train; see its docstrings. The time-limit warning (SIGUSR1) is latched
before torch is imported (distlm.runtime.stop_latch): one that comes while the rank starts is not lost;
once the training has returned or raised, it is ignored: one that comes while the rank exits does
not kill it.
"""

import argparse
from pathlib import Path

from distlm.core.log import setup_logging
from distlm.runtime import stop_latch


def main() -> None:
    stop_latch.latch()  # first: a warning during the seconds below is kept, not dropped
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument(
        "--config", required=True, help="resolved config JSON (results/config/train.json)"
    )
    p.add_argument("--tokens", required=True, type=Path)
    p.add_argument("--tokenizer", required=True, type=Path)
    p.add_argument(
        "--model", required=True, type=Path, help="model folder with the initial weights"
    )
    p.add_argument("--out", required=True, type=Path, help="stage output folder (results/train)")
    p.add_argument("--rank-log", default=None, help="per-rank log file; {rank} is filled in")
    a = p.parse_args()
    setup_logging(a.rank_log)
    # torch and the trainer are imported after the latch and the log
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(_train)(a)
    finally:
        stop_latch.ignore()  # last: Python's exit would make SIGUSR1 fatal again


def _train(a: argparse.Namespace) -> None:
    from distlm.core.documents import read_document
    from distlm.settings.train import TrainConfig
    from distlm.train import TrainPaths, run_training

    run_training(
        read_document(a.config, TrainConfig),
        TrainPaths(tokens=a.tokens, model=a.model, tokenizer=a.tokenizer, out=a.out),
    )


if __name__ == "__main__":
    main()
