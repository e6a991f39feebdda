"""Weight broadcast under torchrun (rule broadcast): rank 0 sends the serialized model to every
other rank through distlm.transfer; every receiver verifies; rank 0 writes the JSON report.

    torchrun --standalone --nproc-per-node=3 -m distlm.entry.broadcast \
        --config results/config/broadcast.json --model results/model/base \
        --report results/broadcast/report.json --rank-log 'logs/broadcast/rank{rank}.log'
"""

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from distlm.broadcast import run_broadcast_stage
from distlm.core.documents import read_document
from distlm.core.log import setup_logging
from distlm.runtime.dist import distributed
from distlm.settings.transfer import BroadcastConfig


@record
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", required=True, help="resolved config (results/config/broadcast.json)"
    )
    p.add_argument("--model", required=True, help="model folder of the model stage")
    p.add_argument("--report", required=True, help="output JSON report (written by rank 0)")
    p.add_argument("--rank-log", required=True, help="per-rank log file; {rank} is filled in")
    args = p.parse_args()
    setup_logging(args.rank_log)
    cfg = read_document(args.config, BroadcastConfig)
    rt = cfg.runtime
    with distributed(
        backend=rt.backend,
        device=rt.device,
        timeout_s=rt.timeout_s,
        ranks_key="broadcast.receivers",
    ) as topo:
        run_broadcast_stage(cfg, topo=topo, model_dir=args.model, report_path=args.report)


if __name__ == "__main__":
    main()
