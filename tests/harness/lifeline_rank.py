"""An MPI rank that does what workflow/scripts/infer.py does first (logging, the lifeline, MPI up),
then prints its pid and waits: tests/test_lifeline.py kills its launchers and watches it die."""

import os
import time

from mpi4py import MPI

from distlm.lifeline import bind_to_launcher
from distlm.log import setup_logging

setup_logging()
bind_to_launcher(poll_s=0.5)
comm = MPI.COMM_WORLD
comm.Barrier()
print(f"rank {comm.Get_rank()} pid {os.getpid()}", flush=True)
time.sleep(300)
