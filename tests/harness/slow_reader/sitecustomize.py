"""A launcher slow to read its ranks' output, for the MPI error-path test (tests/test_inference.py).
Python imports this module at start-up when its folder is on PYTHONPATH. In MPI rank 1 only, the
first error the library logs first stops the rank's parent (MPICH's hydra proxy, which reads the
rank's stdout and stderr) and has it resumed a second later: the error is written while nobody
reads the pipe, as on a loaded node whose proxy is not scheduled. Nothing else changes."""

import logging
import os
import signal
import subprocess

if os.environ.get("PMI_RANK") == "1":
    _error = logging.Logger.error

    def _error_with_a_stopped_reader(self, *args, **kwargs):
        proxy = os.getppid()
        subprocess.Popen(["sh", "-c", f"sleep 1; kill -CONT {proxy}"])
        os.kill(proxy, signal.SIGSTOP)
        logging.Logger.error = _error
        return _error(self, *args, **kwargs)

    logging.Logger.error = _error_with_a_stopped_reader
