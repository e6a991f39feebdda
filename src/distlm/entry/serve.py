"""Serve mode: an OpenAI-compatible API server in front of the MPI pipeline (rule serve).

    python -m distlm.entry.serve --launcher "mpiexec -n S" --config results/config/serve.json \
        --model results/train/final [--host 127.0.0.1] [--port 8000]

This process is the API server's supervisor (distlm.inference.server.supervisor): it listens on
--host/--port (default serve.host/port), starts serve.api_servers HTTP processes on that socket
and the pipeline with the launcher; each talks to stage 0 over ZeroMQ. With
--engine (what the API server passes to the launcher) every rank runs its stage and stage 0 runs
the engine (distlm.inference.engine.serve); with --api (what the supervisor starts
serve.api_servers times) the process is one HTTP server (distlm.inference.server.api_process).
"""

import argparse
import sys
from pathlib import Path

from distlm.core.documents import read_document
from distlm.core.log import setup_logging
from distlm.settings.inference import ServeConfig

MODULE = "distlm.entry.serve"  # what the API server starts (with --engine) in every rank


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument(
        "--config", required=True, help="resolved config (results/config/serve.json)"
    )
    parser.add_argument("--model", required=True, help="model folder with shards/ (one per rank)")
    parser.add_argument("--launcher", help='command that starts the pipeline ("mpiexec -n 3")')
    parser.add_argument("--host", help="bind address (default: serve.host)")
    parser.add_argument("--port", type=int, help="port (default: serve.port)")
    parser.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds for the pipeline to come up"
    )
    parser.add_argument(
        "--endpoint",
        help="where to say the server listens while it is up, with serve.follow_training "
        "(the serve rule passes results/serve/endpoint.json)",
    )
    parser.add_argument(
        "--engine", action="store_true", help="run a pipeline rank (set by the API server)"
    )
    parser.add_argument(
        "--api", action="store_true", help="run an API server process (set by the supervisor)"
    )
    parser.add_argument("--channel", help="engine, api: the folder of the engine channels")
    parser.add_argument(
        "--api-servers", type=int, default=1, help="engine: the API server processes"
    )
    parser.add_argument("--api-pid", type=int, help="engine: stop when this process is gone")
    parser.add_argument("--index", type=int, help="api: this process's channel")
    parser.add_argument("--incarnation", type=int, help="api: this process's starts so far")
    parser.add_argument("--fd", type=int, help="api: the listening socket")
    args = parser.parse_args()
    cfg = read_document(args.config, ServeConfig)

    if args.engine:
        from distlm.inference.engine.serve import run_engine

        setup_logging()
        run_engine(
            cfg.inference,
            device=cfg.runtime.device,
            model_dir=args.model,
            channel=args.channel,
            api_servers=args.api_servers,
            api_pid=args.api_pid,
        )
        sys.exit(0)

    if args.api:
        from distlm.inference.server.api_process import ApiProcess
        from distlm.inference.server.supervisor import read_token

        setup_logging(rank=f"api{args.index}")
        sys.exit(
            ApiProcess(
                cfg.serve,
                cfg.inference,
                model_dir=Path(args.model),
                channel=args.channel,
                index=args.index,
                incarnation=args.incarnation,
                fd=args.fd,
                token=read_token(cfg.serve),
            ).run()
        )

    if args.launcher is None:
        parser.error("--launcher is required (or --engine, inside the MPI job)")
    setup_logging(rank="supervisor")
    from distlm.inference.server.supervisor import run_api_server

    sys.exit(
        run_api_server(
            cfg.serve,
            cfg.inference,
            launcher=args.launcher,
            module=MODULE,
            config=args.config,
            model_dir=args.model,
            host=args.host,
            port=args.port,
            start_timeout_s=args.start_timeout,
            endpoint=args.endpoint,
        )
    )


if __name__ == "__main__":
    main()
