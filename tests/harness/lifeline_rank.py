"""An MPI rank that does what distlm.entry.infer does first (logging, the lifeline, MPI up),
then prints its pid and waits: tests/test_lifeline.py kills its launchers and watches it die."""

import os
import time

from mpi4py import MPI

from distlm.core.log import setup_logging
from distlm.runtime.lifeline import bind_to_launcher

setup_logging()
bind_to_launcher(poll_s=0.5)
comm = MPI.COMM_WORLD
comm.Barrier()
# One write(2): with PYTHONUNBUFFERED, print() writes its pieces one by one and hydra's forwarding
# interleaves the two ranks' lines ("rankrank 1 pid .. 0 pid ..")
os.write(1, f"rank {comm.Get_rank()} pid {os.getpid()}\n".encode())
time.sleep(300)
