"""Serve mode: an OpenAI-compatible HTTP server in front of the MPI pipeline (rule serve).

    python workflow/scripts/serve.py --launcher "mpiexec -n S" --config results/config/inference.json \
        --model results/train/final [--host 127.0.0.1] [--port 8000]

With --launcher (what the serve rule runs), this process is the HTTP front (distlm.inference.front):
it listens on --host/--port, starts the pipeline with the launcher, relays requests to stage 0 and
answers 503 when the job dies. Without it, run under a launcher, every rank runs its stage and
stage 0 serves HTTP itself (`mpiexec -n S python workflow/scripts/serve.py ...`); that is also how the
front starts the job. --host/--port override inference.serve.host/port for this run.
"""

import argparse
import sys

from distlm.config import read_resolved
from distlm.log import setup_logging

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True, help="resolved config (results/config/inference.json)")
parser.add_argument("--model", required=True, help="model folder with shards/ (one shard per rank)")
parser.add_argument("--host", help="bind address (default: inference.serve.host)")
parser.add_argument("--port", type=int, help="port (default: inference.serve.port)")
parser.add_argument("--launcher", help='start the pipeline with this command and serve in front of it ("mpiexec -n 3")')
parser.add_argument("--start-timeout", type=float, default=900.0, help="front: seconds for the pipeline to come up")
parser.add_argument("--ready-file", help="stage 0 writes its address here once it listens (set by the front)")
parser.add_argument("--front-pid", type=int, help="the front's pid: stage 0 stops when it is gone (set by the front)")
args = parser.parse_args()

setup_logging(rank="front" if args.launcher is not None else None)
cfg = read_resolved(args.config)
if args.launcher is not None:
    from distlm.inference.front import run_front

    sys.exit(run_front(
        cfg["inference"], launcher=args.launcher, script=__file__, config=args.config, model_dir=args.model,
        host=args.host, port=args.port, start_timeout_s=args.start_timeout,
    ))

from distlm.inference.server import run_server

run_server(
    cfg["inference"], device=cfg["runtime"]["device"], model_dir=args.model, host=args.host, port=args.port,
    ready_file=args.ready_file, front_pid=args.front_pid,
)
