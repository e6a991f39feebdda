"""A torch.distributed job for the SLURM tests, started by torchrun (through distlm-launch):
every rank all-reduces its rank and gathers hostnames over gloo; rank 0 writes them as JSON.

    python ddp_check.py OUT.json [--fail-rank R]   # R exits with status 7 before the all-reduce
"""

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--fail-rank", type=int, default=None)
a = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
if rank == a.fail_rank:
    print(f"ddp_check: rank {rank} fails on purpose", file=sys.stderr, flush=True)
    os._exit(7)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
hosts = [None] * world
dist.all_gather_object(hosts, (socket.gethostname(), os.environ.get("MASTER_ADDR")))
if rank == 0:
    with open(a.out + ".tmp", "w") as f:
        json.dump({"world_size": world, "sum": t.item(), "hosts": hosts}, f)
    os.replace(a.out + ".tmp", a.out)
dist.destroy_process_group()
