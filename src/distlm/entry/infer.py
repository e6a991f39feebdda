"""Pipeline-parallel generation, one MPI rank per stage (rule inference).

    mpiexec -n S python -m distlm.entry.infer --config results/config/inference.json \
        --model results/train/final --prompts config/prompts.txt \
        --generations results/inference/generations.jsonl --timing results/inference/timing.json
"""

import argparse

from distlm.core.documents import read_document
from distlm.core.log import setup_logging
from distlm.inference.engine.batch import run_batch
from distlm.settings.inference import InferenceConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument(
        "--config", required=True, help="resolved config (results/config/inference.json)"
    )
    parser.add_argument(
        "--model", required=True, help="model folder with shards/ (one shard per rank)"
    )
    parser.add_argument("--prompts", required=True, help="prompt file, one prompt per line")
    parser.add_argument("--generations", required=True, help="output JSONL")
    parser.add_argument("--timing", required=True, help="output timing JSON")
    args = parser.parse_args()

    setup_logging()
    cfg = read_document(args.config, InferenceConfig)
    run_batch(
        cfg.inference,
        device=cfg.runtime.device,
        model_dir=args.model,
        prompts_path=args.prompts,
        generations_path=args.generations,
        timing_path=args.timing,
    )


if __name__ == "__main__":
    main()
