"""An MPI job for the SLURM tests (mpi4py + mpich from pip, started by `srun --mpi=pmi2`):
prints one JSON line from rank 0 with the world size, an allreduce and every rank's host."""

import json
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
hosts = comm.allgather(socket.gethostname())
total = comm.allreduce(comm.rank + 1)
# A message from the last rank to rank 0 (point to point, across nodes when they differ).
if comm.rank == comm.size - 1 and comm.size > 1:
    comm.send(socket.gethostname(), dest=0)
last = comm.recv(source=comm.size - 1) if comm.rank == 0 and comm.size > 1 else None
if comm.rank == 0:
    print(json.dumps({"size": comm.size, "sum": total, "hosts": hosts, "from_last": last}))
