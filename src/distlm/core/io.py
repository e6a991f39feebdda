"""Atomic writes, digests and small JSON helpers shared by every stage.

Every artifact is written to a temporary name in the destination folder and renamed when complete,
so a killed job never leaves a file (or folder) that looks finished.

What the atomic writers guarantee to every stage, whichever library writes the bytes:
- Modes: every file gets `0666 & ~umask`, every folder `0777 & ~umask` (a folder keeps its setgid
  bit, so a group project folder hands its group down), as other tools do. Libraries that make
  private files (safetensors writes through a 0600 temporary file and renames it onto the target;
  `shutil.copy2` copies its source's mode) are corrected when the write completes.
- A full disk or quota (ENOSPC, EDQUOT): the partial files go, what was at the target stays as it
  was, and `DiskFull` names the target, the bytes the write needs and the bytes free.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distlm import DistlmError

_CHUNK = 8 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(root: str | os.PathLike) -> None:
    """Give `root` (a file, or a folder and everything in it) the modes a new file or folder gets
    from the umask: files `0666 & ~umask`, folders `0777 & ~umask` plus their setgid bit (set by
    a setgid parent, it keeps new files in the parent's group). Symbolic links are left alone."""
    mask = _umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    root = Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, file_mode)
        return
    for folder, dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.chmod(p, file_mode)
        os.chmod(folder, dir_mode | (os.stat(folder).st_mode & stat.S_ISGID))


def new_temp_file(path: str | os.PathLike) -> tuple[int, Path]:
    """A new empty file next to `path`, named as a leftover of this writer (`remove_leftovers`),
    with the umask's mode (mkstemp makes 0600); returns its open descriptor and its path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent
    )
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, Path(tmp)


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
        from distlm.core.log import get_logger

        get_logger(__name__).info(
            "removed %d leftovers of interrupted writes in %s: %s",
            len(removed),
            folder,
            ", ".join(p.name for p in removed),
        )
    return removed


# ----------------------------------------------------------------------------- a full disk


class DiskFull(DistlmError):
    """A write ran out of space (ENOSPC) or quota (EDQUOT). Its partial files are gone and what
    was at `path` before is untouched; `needed` is the size of the whole write (an estimate made
    before writing, or what it had written when it failed), `free` the bytes free after cleanup."""

    def __init__(self, path: Path, *, reason: str, needed: int, estimated: bool, free: int):
        self.path, self.reason, self.needed, self.free = path, reason, needed, free
        mount = mount_point(path.parent)
        quota = (
            " (a quota ran out, not the file system: `quota -s` shows yours)"
            if reason == os.strerror(errno.EDQUOT)
            else ""
        )
        need = (
            f"needs {needed} bytes ({human_bytes(needed)})"
            if estimated
            else f"needs more than the {needed} bytes ({human_bytes(needed)}) it had written"
        )
        super().__init__(
            f"{path}: {reason}{quota}: writing it {need}, {free} bytes ({human_bytes(free)}) are "
            f"free on {mount}. Its partial files are removed and what was there before is "
            "unchanged; free space, then run the same command again."
        )


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries that re-raise an OS error as their own exception spell it (safetensors:
# "I/O error: No space left on device (os error 28)"; h5py keeps errno, torch.save drops it).
_FULL_TEXT = {f"os error {n}": os.strerror(n) for n in _FULL_ERRNOS} | {
    os.strerror(n): os.strerror(n) for n in _FULL_ERRNOS
}


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception it was raised from or while handling."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is not None and all(e is not s for s in seen):
            seen.append(e)
            todo += [e.__cause__, e.__context__]
    return seen


def disk_full_reason(exc: BaseException, folder: Path) -> str | None:
    """Why `exc`, raised while writing into `folder`, is a full disk or quota ("No space left on
    device", "Disk quota exceeded"), or None when it is not: an OSError with ENOSPC/EDQUOT or its
    text anywhere in the exception's chain, else (a library that drops the OS error, as
    `torch.save` to a path does) no block left for unprivileged writers on `folder`'s file
    system."""
    for e in _chain(exc):
        if isinstance(e, DiskFull):
            return e.reason
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return os.strerror(e.errno)
        for text, reason in _FULL_TEXT.items():
            if text in str(e):
                return reason
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return os.strerror(errno.ENOSPC) if st.f_bavail == 0 else None


def free_bytes(folder: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still write on `folder`'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the file system that holds `path` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


def tree_bytes(path: Path) -> int:
    """Apparent size of a file, or of every file under a folder (0 when gone)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def nbytes(obj: Any) -> int:
    """Bytes of the arrays (torch tensors, numpy arrays) in a nested dict/list/tuple: what a
    write of them needs before its format's overhead, known before writing (`size=` below)."""
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    n = getattr(obj, "nbytes", None)
    return n if isinstance(n, int) else 0


def human_bytes(n: int) -> str:
    """`n` bytes for people: 512 B, 3.4 MiB, 1.2 GiB."""
    if abs(n) < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if abs(x) < 1024:
            return f"{x:.1f} {unit}"
    return f"{x / 1024:.1f} TiB"


def full_disk_error(e: BaseException, path: Path, *, written: int) -> DiskFull | None:
    """The DiskFull to raise from `e` when it is a full disk or quota, for a write of `path` that
    had written `written` bytes (its partial files already removed), else None."""
    reason = disk_full_reason(e, path.parent)
    if reason is None:
        return None
    for err in _chain(e):  # let go of the partial files' buffers (see _raise_if_full)
        traceback.clear_frames(err.__traceback__)
    free = free_bytes(path.parent)
    return DiskFull(path, reason=reason, needed=written, estimated=False, free=free)


def _raise_if_full(e: Exception, path: Path, tmp: Path | None, size: int | None) -> None:
    """After a failed write into `tmp` (the temporary of `path`, None before it was made): remove
    it and, when the disk or quota is full, raise DiskFull (from `e`); else return, and the
    caller re-raises `e`."""
    reason = disk_full_reason(e, path.parent)
    written = 0
    if tmp is not None and tmp.exists():
        written = tree_bytes(tmp)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    if reason is None:
        return
    # A library's writer may still hold its deleted partial file open from a frame of the
    # traceback (torch.save's zip writer does): drop those frames' locals so the space is free
    # now, and the figure below says what the user will see.
    for err in _chain(e):
        traceback.clear_frames(err.__traceback__)
    free = free_bytes(path.parent)
    if size is not None and size > written:
        raise DiskFull(path, reason=reason, needed=size, estimated=True, free=free) from e
    raise DiskFull(path, reason=reason, needed=written, estimated=False, free=free) from e


# ----------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success give it the umask's mode, fsync it and
    rename it onto `path`, else delete it. Leftovers of an earlier writer of `path` that was
    killed go first. `size`: the bytes the write needs, when known before writing (`nbytes`);
    a full disk raises DiskFull with it."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent, path.name)
        fd, tmp = new_temp_file(path)
        os.close(fd)
        yield tmp
        apply_umask(tmp)  # a library may have replaced the file (safetensors writes 0600)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except Exception as e:
        _raise_if_full(e, path, tmp, size)
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, size: int | None = None) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `path`; on success everything in it gets the
    umask's modes and is fsynced, and it replaces `path` whole. Leftovers of an earlier writer of
    `path` that was killed go first. `size`: the bytes the write needs, when known before
    writing (`nbytes`); a full disk raises DiskFull with it, and `path` stays as it was."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent, path.name)
        tmp = Path(
            tempfile.mkdtemp(
                prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent
            )
        )
        yield tmp
        apply_umask(tmp)  # mkdtemp makes 0700; writers may make 0600 files
        fsync_tree(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{_writer_tag()}")
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        _raise_if_full(e, path, tmp, size)
        raise
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete folder `path` as one step: it is renamed to a leftover name of this writer first, so
    a kill halfway leaves no partial folder under its own name; the next start removes the
    leftover (remove_leftovers)."""
    path = Path(path)
    gone = path.with_name(f".{path.name}.old-{_writer_tag()}")
    try:
        os.replace(path, gone)
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)
    shutil.rmtree(gone, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    data = text.encode("utf-8")
    with atomic_path(path, size=len(data)) as tmp:
        tmp.write_bytes(data)


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


def check_sha256(path: str | os.PathLike, expected: str, *, named_by: str, missing: str) -> None:
    """A file that must be there with the sha256 a document names: a DistlmError naming the file
    when it is not there (`missing`: what it is, and who names it) or holds other bytes
    (`named_by`: the document, and where in it, that gives `expected`)."""
    path = Path(path)
    if not path.is_file():
        raise DistlmError(f"{path}: {missing}")
    actual = sha256_file(path)
    if actual != expected:
        raise DistlmError(f"{path}: sha256 {actual} does not match {named_by}")


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
