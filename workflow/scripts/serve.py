"""Serve mode: an OpenAI-compatible HTTP server on stage 0 of the MPI pipeline (rule serve).

    mpiexec -n S python workflow/scripts/serve.py --config results/config/inference.json \
        --model results/train/final [--host 127.0.0.1] [--port 8000]

--host/--port override inference.serve.host/port for this run; everything else comes from the config.
"""

import argparse

from distlm.config import read_resolved
from distlm.inference.server import run_server
from distlm.log import setup_logging

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True, help="resolved config (results/config/inference.json)")
parser.add_argument("--model", required=True, help="model folder with shards/ (one shard per rank)")
parser.add_argument("--host", help="bind address (default: inference.serve.host)")
parser.add_argument("--port", type=int, help="port (default: inference.serve.port)")
args = parser.parse_args()

setup_logging()
cfg = read_resolved(args.config)
run_server(cfg["inference"], device=cfg["runtime"]["device"], model_dir=args.model, host=args.host, port=args.port)
