"""Results honour the umask: every file distlm writes (weights, shards and checkpoints included)
gets 0666 & ~umask, every folder 0777 & ~umask, so a group project folder with umask 002 is one a
teammate can evaluate, resume and serve from."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, SINGLE, TINY, snakemake_cmd
from harness.synthetic import checkpoint_state, run_identity

from distlm.dag.config import validate_settings
from distlm.data import prepare
from distlm.model import serialize, write_pipeline_dir
from distlm.runtime.device import DeviceBackend
from distlm.runtime.lease import Lease
from distlm.settings.model import ModelConfig
from distlm.train import checkpoint as ck
from distlm.train import identity as ident


def modes(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (root included) -> its permission bits, octal."""
    out = {".": oct(stat.S_IMODE(root.stat().st_mode))}
    for folder, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(folder) / n
            if not p.is_symlink():
                out[str(p.relative_to(root))] = oct(stat.S_IMODE(p.lstat().st_mode))
    return out


def wrong_modes(root: Path, *, file_mode: int, dir_mode: int, skip=()) -> dict[str, str]:
    want = {True: oct(dir_mode), False: oct(file_mode)}
    return {
        k: v
        for k, v in modes(root).items()
        if k != "." and not k.startswith(skip) and v != want[(root / k).is_dir()]
    }


def test_every_writer_honours_umask_002_in_a_setgid_folder(tmp_path):
    """Data, model folder, shards, a checkpoint and the trainer's lease written with umask 002 in
    a setgid folder: files 0664, folders 2775 (the setgid bit handed down)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    old = os.umask(0o002)
    try:
        c = validate_settings(
            {
                "data": {"block_size": 32, "tokenizer": {"vocab_size": 300}},
                "model": {"init": {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64}},
            }
        )
        data = shared / "data"
        prepare(
            c.data,
            c.model,
            tokens_path=data / "tokens.h5",
            tokenizer_dir=data / "tokenizer",
            stats_path=data / "stats.json",
        )
        kw = {"tokenizer_dir": data / "tokenizer", "tokens_path": data / "tokens.h5"}
        mcfg = ModelConfig.of({"model": c.model.model_dump(mode="json")})  # the rule's document
        serialize(mcfg, **kw, out_dir=shared / "model")
        write_pipeline_dir(shared / "model", shared / "pipeline", stages=2)
        weights = {"w": torch.randn(100)}
        optimizer = {"state": {0: {"exp_avg": torch.randn(100)}}, "param_groups": []}
        rng = [DeviceBackend.cpu().rng_state()]
        run = ident.open_run(shared / "checkpoints", run_identity())
        ck.write(
            run, weights=weights, optimizer_state=optimizer, rng_states=rng,
            state=checkpoint_state(1), keep_last=1,
        )  # fmt: skip
        with Lease(shared / "checkpoints" / "trainer.lease.json", what="training"):
            held = oct(stat.S_IMODE((shared / "checkpoints" / "trainer.lease.json").stat().st_mode))
    finally:
        os.umask(old)
    assert held == "0o664"
    assert (shared / "model" / "model.safetensors").is_file()
    assert (shared / "pipeline" / "shards" / "stage-00.safetensors").is_file()
    assert wrong_modes(shared, file_mode=0o664, dir_mode=0o2775) == {}


# ----------------------------------------------------------------------------- two users

GROUP, USERS = "distlm-grp", ("distlm-u1", "distlm-u2")
_TOOLS = ("useradd", "groupadd", "runuser")


def _ensure_users() -> None:
    """The group and its two users (idempotent)."""
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    for u in USERS:
        try:
            pwd.getpwnam(u)
        except KeyError:
            subprocess.run(["useradd", "-M", "-N", "-g", GROUP, "-s", "/bin/sh", u], check=True)


def _blocked_paths() -> list[Path]:
    """Folders above the interpreter and this checkout that other users cannot enter (a Python
    installed under /root): the test lets others through them (o+x, no listing) for its
    duration and restores their modes."""
    out = []
    for target in (Path(sys.executable).resolve(), ROOT):
        for p in [*reversed(target.parents)]:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                out.append(p)
    return sorted(set(out))


def _as(user: str, cmd: list[str], home: Path, **kw) -> subprocess.Popen:
    """`cmd` as `user` with umask 002, this interpreter first on PATH and this checkout's library."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT / "src")),
        "LANG": "C.UTF-8",
    }
    shell = "umask 002 && exec " + " ".join(_quote(c) for c in cmd)
    return subprocess.Popen(
        [
            "runuser",
            "-u",
            user,
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in env.items()),
            "sh",
            "-c",
            shell,
        ],
        **kw,
    )


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _run_as(user: str, cmd: list[str], home: Path, timeout: float = 600) -> str:
    p = _as(user, cmd, home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"{user}: {' '.join(cmd)} failed:\n{out[-6000:]}"
    return out


@pytest.mark.slow
@pytest.mark.with_slurm
@pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in _TOOLS),
    reason=f"two users need root and {', '.join(_TOOLS)} (CI runs as root)",
)
def test_a_teammate_evaluates_resumes_and_serves_what_another_trained(tmp_path):
    """User 1 runs the tiny workflow in a setgid group folder with umask 002: every file under
    results/ is 0664 and every folder 2775. User 2 (same group, umask 002) then re-evaluates,
    trains the same run further and serves it to a real client."""
    from distlm.runtime.dist import free_port

    _ensure_users()
    gid = grp.getgrnam(GROUP).gr_gid
    blocked = {p: p.stat().st_mode for p in _blocked_paths()}
    for p, mode in blocked.items():
        os.chmod(p, stat.S_IMODE(mode) | stat.S_IXOTH)
    project = Path("/tmp") / f"distlm-umask-{os.getpid()}"
    try:
        project.mkdir(mode=0o2775)
        os.chown(project, 0, gid)
        os.chmod(project, 0o2775)
        homes = {u: project / f".home-{u}" for u in USERS}
        for u, h in homes.items():
            h.mkdir()
            shutil.chown(h, u, GROUP)
        wd = project / "work"
        wd.mkdir()
        os.chown(wd, pwd.getpwnam(USERS[0]).pw_uid, gid)
        os.chmod(wd, 0o2775)
        port = free_port()
        over = project / "more.yaml"
        over.write_text(
            yaml.safe_dump({"train": {"max_steps": 12}, "serve": {"port": port, "stages": 2}})
        )
        os.chmod(over, 0o664)

        # one rank a stage (tiny-single.yaml): every rank writes through the same functions
        tiny = (TINY, SINGLE)
        u1, u2 = USERS
        _run_as(u1, snakemake_cmd(wd, configfiles=tiny), homes[u1])
        bad = wrong_modes(wd / "results", file_mode=0o664, dir_mode=0o2775)
        assert bad == {}, bad
        assert {p.stat().st_gid for p in (wd / "results").rglob("*")} == {gid}

        _run_as(u2, snakemake_cmd(wd, "--forcerun", "evaluate", configfiles=tiny), homes[u2])
        more = (*tiny, over)
        out = _run_as(u2, snakemake_cmd(wd, "train", configfiles=more), homes[u2])
        final = json.loads((wd / "results/train/final/distlm.json").read_text())
        assert final["training"]["steps"] == 12 and final["training"]["resumed_from"], out[-3000:]

        server = _as(
            u2, snakemake_cmd(wd, "serve", configfiles=more), homes[u2],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            health = _wait_health(port, server)
            body = json.dumps({"model": health["model"], "prompt": "The", "max_tokens": 4})
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                answer = json.loads(r.read())
            assert answer["usage"]["completion_tokens"] == 4
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGINT)
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
        bad = wrong_modes(wd / "results", file_mode=0o664, dir_mode=0o2775)
        assert bad == {}, bad
        owners = {p.stat().st_uid for p in (wd / "results").rglob("*")}
        assert owners == {pwd.getpwnam(u).pw_uid for u in USERS}
    finally:
        for p, mode in blocked.items():
            os.chmod(p, stat.S_IMODE(mode))
        shutil.rmtree(project, ignore_errors=True)


def _wait_health(port: int, proc: subprocess.Popen, within: float = 240) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = json.loads(r.read())
                if health.get("status") == "ok":
                    return health
        except OSError:
            pass
        time.sleep(1)
    out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
    raise AssertionError(f"serve did not come up on port {port}: {str(out)[-3000:]}")
