"""Snakemake's command line, many times, without paying its import each time.

A dry run of the tiny workflow takes about 1.4 s of CPU, of which 1.3 s is importing Snakemake and
the library modules the Snakefile reads; the rerun matrix makes about a hundred of them. `Forks`
starts one server process (this module run as a script) that imports `snakemake.cli` and those
modules once, then forks a child per command line. The child calls `snakemake.cli.main(argv)`,
the function the `snakemake` console script calls, with `sys.argv` set as the console script
would have it, its output in files and its exit status returned: the user's command in a process
whose only difference is that its imports were done before the fork. Nothing runs in the server
but imports, so every child starts from the same state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def preload() -> list[str]:
    """What the server imports before it forks: Snakemake's command line and every module the
    Snakefile and its rule files import (read from them, so the list follows the workflow)."""
    names = {"snakemake.cli"}
    for f in (ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))):
        names.update(re.findall(r"^\s*(?:from|import)\s+([\w.]+)", f.read_text(), re.MULTILINE))
    return sorted(names)


class Forks:
    """One server; `run` may be called from several threads (each call forks its own child)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()
        self._replies: dict[int, threading.Event] = {}
        self._codes: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._lock:
                self._codes[reply["id"]] = reply["rc"]
                self._replies.pop(reply["id"]).set()
        with self._lock:  # the server is gone: wake every caller still waiting
            for event in self._replies.values():
                event.set()

    def run(self, cmd: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
        """`python -m snakemake ARGV` (conftest.snakemake_cmd's form) in a forked child; stdout
        and stderr as text, as subprocess.run(cmd, capture_output=True, text=True) gives them."""
        if cmd[:3] != [sys.executable, "-m", "snakemake"]:
            raise ValueError(f"not a snakemake command line: {cmd}")
        argv = cmd[3:]
        with tempfile.TemporaryDirectory(prefix="snakemake-fork-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            done = threading.Event()
            with self._lock:
                rid, self._next = self._next, self._next + 1
                self._replies[rid] = done
            self._send({"id": rid, "argv": argv, "stdout": str(out), "stderr": str(err)})
            if not done.wait(timeout):  # as subprocess.run's timeout: kill the child, then raise
                self._send({"kill": rid})
                done.wait(30)
                with self._lock:
                    self._codes.pop(rid, None)
                raise TimeoutError(f"snakemake {' '.join(argv)}: no exit in {timeout} s")
            with self._lock:
                if rid not in self._codes:
                    raise RuntimeError(f"the fork server exited ({self._proc.poll()})")
                rc = self._codes.pop(rid)
            return subprocess.CompletedProcess(cmd, rc, out.read_text(), err.read_text())

    def _send(self, request: dict) -> None:
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._reader.join(timeout=10)


def _child(request: dict) -> None:
    """In the forked child: the console script's call, its exit status as the process's."""
    import snakemake.cli

    code = 1
    try:
        fds = [
            os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            for k in ("stdout", "stderr")
        ]
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        sys.argv = ["snakemake", *request["argv"]]
        try:
            snakemake.cli.main(request["argv"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve() -> None:
    """Read requests (JSON lines) from stdin; fork a child per request; reply with its status
    when it exits. One thread: the forks never copy a lock another thread holds."""
    import importlib
    import select

    for name in preload():
        importlib.import_module(name)
    reply_to = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # nothing the server or a child prints reaches the reply channel
    children: dict[int, int] = {}  # pid -> request id
    pending, open_ = b"", True
    while open_ or children:
        if open_ and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            open_ = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if "kill" in request:  # a caller's timeout
                    for pid, rid in children.items():
                        if rid == request["kill"]:
                            os.kill(pid, signal.SIGKILL)
                    continue
                pid = os.fork()
                if pid == 0:
                    os.dup2(devnull, 0)
                    reply_to.close()  # the server's alone
                    _child(request)
                children[pid] = request["id"]
        elif not open_:
            select.select([], [], [], 0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rc = os.waitstatus_to_exitcode(status)
            reply_to.write(json.dumps({"id": children.pop(pid), "rc": rc}) + "\n")
            reply_to.flush()


if __name__ == "__main__":
    _serve()
