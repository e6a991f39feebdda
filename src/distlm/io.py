"""Atomic writes, digests and small JSON helpers shared by every stage.

Every artifact is written to a temporary name in the destination folder and renamed when complete,
so a killed job never leaves a file (or folder) that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 8 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (deepest first), `root` included."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(folder, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


# ----------------------------------------------------------------------------- leftovers
#
# Temporary names carry their writer (`.NAME.HOST-PID.RANDOM.tmp`, `.NAME.old-HOST-PID`), so that
# the next start can tell the leftovers of a dead writer from the files of a live one.

_HOST = socket.gethostname().split(".")[0].replace("-", "_") or "host"
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<host>[^.]+)-(?P<pid>\d+)\.[^.]+\.tmp$")
_OLD = re.compile(r"^\.(?P<name>.+)\.old-(?P<host>[^.]+)-(?P<pid>\d+)$")
_LEGACY = re.compile(r"^\.(?P<name>.+?)\.(?:[^.]+\.tmp|old-\d+)$")  # before writers were named
# A writer on another host cannot be asked whether it lives: its leftovers go once untouched
# for this long (no atomic write of distlm takes an hour between two file creations).
STALE_AFTER_S = 3600.0


def _writer_tag() -> str:
    return f"{_HOST}-{os.getpid()}"


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):
            for n in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(folder, n)).st_mtime)
    return newest


def leftover_of(entry: Path, now: float | None = None) -> str | None:
    """The target name when `entry` is a leftover of a dead writer's atomic write, else None."""
    m = _TMP.match(entry.name) or _OLD.match(entry.name)
    if m is not None and m.group("host") == _HOST:
        pid = int(m.group("pid"))
        if pid == os.getpid() or pid_alive(pid):
            return None
        return m.group("name")
    m = m or _LEGACY.match(entry.name)
    if m is None:
        return None
    try:
        age = (now or time.time()) - _newest_mtime(entry)
    except OSError:
        return None
    return m.group("name") if age > STALE_AFTER_S else None


def remove_leftovers(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete the leftovers of interrupted atomic writes in `folder` (only those of dead writers;
    only those of target `name` when given); returns what was removed."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for entry in folder.iterdir():
        if not entry.name.startswith("."):
            continue
        target = leftover_of(entry, now)
        if target is None or (name is not None and target != name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        from distlm.log import get_logger

        get_logger(__name__).info(
            "removed %d leftovers of interrupted writes in %s: %s",
            len(removed),
            folder,
            ", ".join(p.name for p in removed),
        )
    return removed


# ----------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it and rename it onto `path`, else
    delete it. Leftovers of an earlier writer of `path` that was killed go first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent, path.name)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent
    )
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results should read like any file
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `path`; on success every file in it is fsynced and
    it replaces `path` whole. Leftovers of an earlier writer of `path` that was killed go first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent, path.name)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent)
    )
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{_writer_tag()}")
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON, naming the file in the error when it is missing or malformed."""
    from distlm import DistlmError

    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DistlmError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DistlmError(f"{what} {path} is not valid JSON: {e}") from None


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def digest(obj: Any) -> str:
    """A stable sha256 of a JSON-able object (sorted keys): the identity of a config section."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(blob.encode()).hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
