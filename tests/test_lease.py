"""distlm.runtime.lease: one holder at a time; a dead holder's lease is taken over (at once on this host,
by its silent heartbeat from another host); a live one is named in the error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from distlm.core.documents import read_document, write_document
from distlm.runtime.lease import Holder, Lease, LeaseHeld


def _foreign(path, *, host="node-elsewhere", pid=4242, job="977", beat=0, token="t"):
    doc = Holder(
        what="training in results/train",
        host=host,
        pid=pid,
        slurm_job_id=job,
        started_at=time.time(),
        beat=beat,
        token=token,
    )
    write_document(path, doc)
    return doc


def test_a_second_holder_is_refused_naming_the_first(tmp_path, monkeypatch):
    path = tmp_path / "trainer.lease.json"
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    with Lease(path, what="training in results/train"):
        held = read_document(path, Holder)
        assert held.pid == os.getpid() and held.slurm_job_id == "1234"
        with pytest.raises(LeaseHeld) as e:
            Lease(path, what="training in results/train").acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()}" in msg and "SLURM job 1234" in msg and "scancel 1234" in msg
    assert not path.exists()  # released
    with Lease(path, what="again"):
        pass


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    path = tmp_path / "lease.json"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    import socket

    _foreign(path, host=socket.gethostname(), pid=int(dead.stdout))
    t0 = time.monotonic()
    with Lease(path, what="x", ttl_s=30):
        assert read_document(path, Holder).pid == os.getpid()
    assert time.monotonic() - t0 < 5


def test_another_hosts_holder_is_judged_by_its_heartbeat(tmp_path):
    path = tmp_path / "lease.json"
    # silent for ttl: stale, taken over
    _foreign(path)
    t0 = time.monotonic()
    with Lease(path, what="x", ttl_s=1.0):
        pass
    assert 0.9 < time.monotonic() - t0 < 10
    # beating: alive, refused with its host and job
    doc = _foreign(path)
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.wait(0.1):
            n += 1
            write_document(path, doc.model_copy(update={"beat": n}))

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with pytest.raises(LeaseHeld, match="host node-elsewhere, pid 4242, SLURM job 977"):
            Lease(path, what="x", ttl_s=2.0).acquire()
    finally:
        stop.set()
        t.join()


def test_a_holder_whose_lease_was_taken_over_knows_it(tmp_path):
    path = tmp_path / "lease.json"
    lease = Lease(path, what="x", ttl_s=0.3)
    lease.acquire()
    try:
        _foreign(path, token="someone-else")
        deadline = time.monotonic() + 5
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost is not None and "taken over by host node-elsewhere" in lease.lost
    finally:
        lease.release()
    assert read_document(path, Holder).token == "someone-else"  # not ours to remove


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """A stale lease whose pid now belongs to a younger process (pid reuse) is taken over."""
    import socket

    path = tmp_path / "lease.json"
    doc = _foreign(path, host=socket.gethostname(), pid=os.getpid())
    write_document(path, doc.model_copy(update={"started_at": time.time() - 10**6}))
    with Lease(path, what="x"):
        assert read_document(path, Holder).token != "t"
