"""A lease on a stage folder: one writer at a time, across processes, hosts and SLURM jobs.

    with Lease(Path("results/train/checkpoints/trainer.lease.json"), what="training"):
        ...                       # no other holder can take it while this block runs

Why a lease file and not `fcntl`/`flock`: byte-range locks are only as good as the file system's
lock manager, and on the file systems clusters share they are often node-local without saying so
(Lustre mounted with `localflock`, BeeGFS without global file locks) or released late after a
client dies (NFS lockd/statd recovery). A lease needs only what every shared file system gives:
an atomic create-if-absent (`link(2)` of a finished temporary file, safe on NFS since v2) and
close-to-open consistency for the holder's heartbeat, which a reader sees by reopening the file.

- The holder's document (`Holder`) names its host, pid, SLURM job id and start time, so a second
  writer stops with an error that names the running one.
- The holder renews it every `ttl_s / 6` seconds (a new `beat`), from a daemon thread.
- A lease whose holder is on this host and dead is stale at once. A holder on another host is
  judged by its heartbeat, not by clocks: a lease whose `beat` does not change for `ttl_s`
  seconds is stale (its node died or was cut off), and is taken over.
- A holder that finds its lease taken over (another token in the file) reports it on `lost`,
  and stops renewing; the trainer checks it at every step boundary.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import ClassVar, Self

from distlm import DistlmError
from distlm.core.documents import Document, DocumentError, read_document
from distlm.core.io import new_temp_file, pid_alive
from distlm.core.log import get_logger

log = get_logger(__name__)

DEFAULT_TTL_S = 60.0


class LeaseHeld(DistlmError):
    """Another live process holds the lease."""


class Holder(Document):
    """Who holds a lease (the lease file's content)."""

    KIND: ClassVar[str] = "distlm-lease"
    VERSION: ClassVar[int] = 1

    what: str  # what the lease guards, for messages ("training in results/train")
    host: str
    pid: int
    slurm_job_id: str | None
    started_at: float  # wall time the holder took the lease (for people; never compared)
    beat: int  # renewals so far: what other hosts watch
    token: str  # unique per acquisition: tells the holder whether the lease is still its own

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"host {self.host}, pid {self.pid}{job}, started {started}"


def _me(what: str, token: str, beat: int = 0, started_at: float | None = None) -> Holder:
    return Holder(
        what=what,
        host=socket.gethostname(),
        pid=os.getpid(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None,
        started_at=time.time() if started_at is None else started_at,
        beat=beat,
        token=token,
    )


def _write_tmp(path: Path, doc: Holder) -> Path:
    """The document in a finished, fsynced temporary file next to `path`."""
    fd, tmp = new_temp_file(path)  # with the umask's mode: other users of the folder read it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return Path(tmp)


def _process_started(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, from /proc), None when gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class Lease:
    def __init__(self, path: str | os.PathLike, *, what: str, ttl_s: float = DEFAULT_TTL_S):
        self.path = Path(path)
        self.what = what
        self.ttl_s = ttl_s
        self.token = uuid.uuid4().hex
        self.lost: str | None = None  # why the lease is no longer ours, once it is not
        self._holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ acquire

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = _me(self.what, self.token)
        for _ in range(5):
            if self._create(me):
                self._holder = me
                self._thread = threading.Thread(target=self._renew, daemon=True, name="lease")
                self._thread.start()
                log.info("lease %s taken (%s)", self.path, me.describe())
                return
            other = self._read()
            if other is not None and self._alive(other):
                raise LeaseHeld(
                    f"{self.path}: another process is already running {other.what}: "
                    f"{other.describe()}. Two writers never run side by side: wait for it to "
                    "end"
                    + (
                        f" (squeue -j {other.slurm_job_id}; scancel {other.slurm_job_id} ends it)"
                        if other.slurm_job_id
                        else f" (or stop it: kill {other.pid} on {other.host})"
                    )
                    + ", then run the same command again."
                )
            why = "unreadable" if other is None else f"stale ({other.describe()})"
            log.warning("lease %s is %s: taking it over", self.path, why)
            self.path.unlink(missing_ok=True)
        raise LeaseHeld(f"{self.path}: could not take the lease (others keep taking it)")

    def _create(self, me: Holder) -> bool:
        tmp = _write_tmp(self.path, me)
        try:
            os.link(tmp, self.path)  # atomic create-if-absent, NFS included
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> Holder | None:
        try:
            return read_document(self.path, Holder)
        except DocumentError as e:
            if not self.path.exists():
                return None
            log.warning("%s", e)
            return None

    def _alive(self, other: Holder) -> bool:
        """Whether `other` still holds its lease: its pid on this host (and not a later process
        that reuses the pid), else its heartbeat."""
        if other.host == socket.gethostname():
            started = _process_started(other.pid)
            if started is not None:
                return started <= other.started_at + 5  # (its clock: the same machine's)
            return pid_alive(other.pid)
        deadline = time.monotonic() + self.ttl_s
        log.info(
            "lease %s is held from another host (%s): watching its heartbeat for up to %.0f s",
            self.path,
            other.describe(),
            self.ttl_s,
        )
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.ttl_s / 10))
            now = self._read()
            if now is None:
                return False  # released meanwhile: take it
            if now.token != other.token or now.beat != other.beat:
                return True  # renewed, or taken by a third process: alive either way
        return False

    # ------------------------------------------------------------------ hold / release

    def _renew(self) -> None:
        assert self._holder is not None
        beat = 0
        while not self._stop.wait(self.ttl_s / 6):
            current = self._read()
            if current is None or current.token != self.token:
                self.lost = f"lease {self.path} was taken over by " + (
                    current.describe() if current else "nobody (it was removed)"
                )
                log.error("%s", self.lost)
                return
            beat += 1
            doc = self._holder.model_copy(update={"beat": beat})
            tmp = _write_tmp(self.path, doc)
            try:
                os.replace(tmp, self.path)
            except OSError as e:
                log.warning("lease %s: renewal failed (%s)", self.path, e)
            finally:
                tmp.unlink(missing_ok=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._holder is not None and self.lost is None:
            current = self._read()
            if current is not None and current.token == self.token:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            self._holder = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
