"""Checkpoint evaluation under torchrun (rule evaluate): sliding-window perplexity of one model.

    torchrun --standalone --nproc-per-node=2 -m distlm.entry.evaluate \
        --config results/config/eval.json --model results/model/base \
        --tokens results/data/tokens.h5 --name base --out results/eval/base.json \
        --rank-log 'logs/eval/base.rank{rank}.log'
"""

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from distlm.core.documents import read_document
from distlm.core.log import setup_logging
from distlm.evaluate import evaluate_model
from distlm.runtime.dist import distributed
from distlm.settings.eval import EvalConfig


@record
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="resolved config (results/config/eval.json)")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--tokens", required=True, help="HDF5 token file of the data stage")
    p.add_argument("--name", required=True, help="name of the model in the output (base, trained)")
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--rank-log", default=None, help="per-rank log file; {rank} is filled in")
    args = p.parse_args()
    setup_logging(args.rank_log)
    cfg = read_document(args.config, EvalConfig)
    rt = cfg.runtime
    with distributed(
        backend=rt.backend,
        device=rt.device,
        timeout_s=rt.timeout_s,
        ranks_key="eval.nproc_per_node",
        precision=cfg.eval.precision,
        precision_key="eval.precision",
    ) as topo:
        evaluate_model(
            cfg,
            topo=topo,
            model_dir=args.model,
            tokens_path=args.tokens,
            name=args.name,
            out_path=args.out,
        )


if __name__ == "__main__":
    main()
