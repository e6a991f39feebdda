"""One logger for the whole library, with a timestamp and the rank in every line.

Rank 0 also gets progress bars (`progress`); other ranks get none, so their logs stay readable.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    from tqdm import tqdm

T = TypeVar("T")
_FORMAT = "%(asctime)s.%(msecs)03d [rank %(rank)s] %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"


def _env_rank() -> str:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if var in os.environ:
            return os.environ[var]
    return "0"


class _RankFilter(logging.Filter):
    def __init__(self, rank: str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(
    log_file: str | os.PathLike | None = None,
    *,
    rank: int | str | None = None,
    level: int = logging.INFO,
) -> logging.Logger:
    """Configure the `distlm` logger: stderr plus, optionally, a per-rank file.

    `log_file` may contain `{rank}`, which is filled in so every rank writes its own file.
    `rank` labels the lines (a number, or a role such as "front"); by default the launcher's rank.
    """
    rank_s = str(rank) if rank is not None else _env_rank()
    root = logging.getLogger("distlm")
    root.setLevel(level)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter(_FORMAT, _DATEFMT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        path = Path(str(log_file).replace("{rank}", rank_s))
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path, mode="a", encoding="utf-8"))
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(_RankFilter(rank_s))
        root.addHandler(h)
    return root


def get_logger(name: str) -> logging.Logger:
    if not name.startswith("distlm"):
        name = f"distlm.{name}"
    return logging.getLogger(name)


def progress(iterable: Iterable[T] | None = None, *, enabled: bool = True, **kwargs) -> tqdm[T]:
    """A tqdm bar on stderr when `enabled` (pass `topo.is_main`); otherwise a silent iterator."""
    from tqdm.auto import tqdm

    bar = tqdm(iterable, disable=not enabled, dynamic_ncols=True, mininterval=1.0, **kwargs)
    return cast("tqdm[T]", bar)  # tqdm.auto's class is a tqdm; its overloads lose T


def flush_to_reader(timeout_s: float = 10.0) -> None:
    """Before a process is killed by its own hand (MPI_Abort, which ends every rank): flush the
    library's log handlers and stdio, and where stdout or stderr is a pipe (an MPI proxy, torchrun
    or srun reads it), wait until the reader has taken every byte, at most `timeout_s` seconds.
    A launcher that is slow to read (a loaded node) would otherwise be told to kill the job while
    the error that explains it still sits in the pipe, and the user would see an exit code and
    nothing else."""
    import fcntl
    import stat
    import struct
    import termios
    import time

    for h in logging.getLogger("distlm").handlers:
        h.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout_s
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            # FIONREAD on either end of a pipe: the bytes written and not yet read
            while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
        except OSError:
            continue
