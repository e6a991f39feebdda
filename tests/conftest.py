"""Shared fixtures: the repository root, Snakemake runs in scratch folders, the tiny workflow."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# tests/run.sh runs three pytest sessions on CI's two cores. OpenMP's default wait policy keeps
# an idle torch thread spinning after every parallel region; with the cores shared, the spinning
# takes the CPU the other processes need (150 forwards of the tiny GPT-2 with torch's 2 threads
# beside a CI run: 4.6 s of CPU and 11.8 s wall, passive: 0.57 s and 0.91 s). Set before torch
# loads; every process the tests start inherits it. What a test checks does not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "tiny.yaml"
SINGLE = ROOT / "tests" / "configs" / "tiny-single.yaml"  # layered after TINY: one rank a stage
SLURM_CONFIG = ROOT / "tests" / "harness" / "slurm-config.yaml"


# Snakemake's options that take several values read a target after them as one more value
# (`--configfile A B results/x` reads results/x as a config file): the user's command line here
# puts the targets first, and config files go in `configfiles`, never in `args`.


def snakemake_cmd(
    workdir: Path,
    *args: str,
    configfiles: tuple[Path, ...] = (TINY,),
    profile: str | Path = ROOT / "profiles" / "local",
) -> list[str]:
    """The user's command line: `snakemake TARGETS... OPTIONS... --directory WORKDIR
    --configfile ... --profile ...`: `args` (targets, then options) first, so that no target
    follows an option that takes several values."""
    if any(a in ("--configfile", "--configfiles") for a in args):
        raise ValueError("snakemake_cmd: give config files as configfiles=, not in args")
    many = None  # --config's values are KEY=VALUE: one without "=" is a target it swallows
    for a in args:
        if a.startswith("-"):
            many = a if a in ("--config", "-C") else None
        elif many is not None and "=" not in a:
            raise ValueError(f"snakemake_cmd: {a!r} after {many} is read as a config value")
    conf = ["--configfile", *map(str, configfiles)] if configfiles else []
    return [
        sys.executable,
        "-m",
        "snakemake",
        *args,
        "-s",
        str(ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        *conf,
        "--profile",
        str(profile),
    ]


def run_snakemake(
    workdir: Path,
    *args: str,
    configfile: Path | None = TINY,
    configfiles: tuple[Path, ...] | None = None,
    profile: str | Path = ROOT / "profiles" / "local",
    check: bool = True,
    timeout: float = 1200,
    env: dict[str, str | None] | None = None,
) -> subprocess.CompletedProcess:
    """Run the workflow with `workdir` as its working directory (results/ and logs/ land there);
    `args`: targets first, then options; `configfiles` (default: `configfile` alone) in order;
    `env` changes this process's environment for it (a None value removes the variable)."""
    if configfiles is None:
        configfiles = (configfile,) if configfile else ()
    cmd = snakemake_cmd(workdir, *args, configfiles=configfiles, profile=profile)
    started = time.time()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-10000:]}"
            f"{recent_logs(workdir, since=started)}"
        )
    return proc


def recent_logs(workdir: Path, *, since: float, each: int = 2500, total: int = 15000) -> str:
    """The tails of the rule and rank logs written during a failed run, newest last, so a failure
    on CI (whose scratch folders are gone afterwards) shows what every process said."""
    logs = sorted(
        (p for p in (Path(workdir) / "logs").rglob("*.log") if p.stat().st_mtime >= since - 1),
        key=lambda p: p.stat().st_mtime,
    )
    parts = []
    for p in logs:
        text = p.read_text(errors="replace")
        parts.append(
            f"\n--- {p.relative_to(workdir)} (last {min(each, len(text))} chars) ---\n"
            f"{text[-each:]}"
        )
    out = "".join(parts)
    return out[-total:] if out else "\n(no rule logs written during the run)"


# Fixtures that run the whole workflow or a cluster: a test that uses one is slow by definition.
# runs, layouts: gloo ranks (tests/test_fsdp.py)
_SLOW_FIXTURES = {"workflow_run", "slurm_run", "cluster", "slurm_built", "runs", "layouts"}


def pytest_collection_modifyitems(config, items):
    """`-m "not slow"` is the development loop: whole-workflow, SLURM and network-namespace tests
    carry the slow marker without each test repeating it."""
    for item in items:
        slow = _SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if slow or item.get_closest_marker("slurm") or item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.slow)


def _once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills, made once per test session, or once for all the
    sessions of one tests/run.sh: DISTLM_TESTS_WORKFLOW names a folder they share; the first
    session to need `name` builds it there (the others wait on its lock), the others use it."""
    shared = os.environ.get("DISTLM_TESTS_WORKFLOW")
    if not shared:
        wd = tmp_path_factory.mktemp(name)
        build(wd)
        return wd
    root = Path(shared)
    wd, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(wd, ignore_errors=True)  # what a session that failed in it left
            wd.mkdir()
            build(wd)
            done.touch()
    return wd


def processes_of(workdir: Path) -> Path:
    """Where the processes of the tiny workflow's run wrote what they loaded (workflow_run)."""
    return workdir.parent / f"{workdir.name}-processes"


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory) -> Path:
    """The whole tiny workflow, run once per test session (or once for tests/run.sh's sessions:
    _once_per_run); returns its working directory. Tests read it; a test that runs jobs or edits
    files works on a copy (copy_workflow). Each of its Python processes writes what it loaded
    into `processes_of(workdir)` (tests/harness/process_hooks)."""
    from harness.processes import process_env

    def build(wd: Path) -> None:
        shutil.rmtree(processes_of(wd), ignore_errors=True)  # a failed build's records
        run_snakemake(wd, env=dict(process_env(processes_of(wd))))

    return _once_per_run(tmp_path_factory, "workflow", build)


@pytest.fixture(scope="session")
def snakemake_forks():
    """The user's `snakemake` command lines in processes forked after Snakemake's import, for the
    tests that make dozens of dry runs (tests/harness/snakemake_forks.py)."""
    from harness.snakemake_forks import Forks

    forks = Forks()
    yield forks
    forks.close()


@pytest.fixture(scope="session")
def pipeline_folders(tmp_path_factory):
    """case -> the tiny model's pipeline folders of 1, 2 and 3 stages ({stages: folder}), built
    once per session: "gpt2" (tests/test_inference.py's) or a Llama-family case of
    tests/harness/families.py."""
    from harness.families import build_family_models
    from test_inference import build_tiny_models

    root = tmp_path_factory.getbasetemp()
    cache: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in cache:
            if case == "gpt2":
                cache[case] = build_tiny_models(root / "inference-models")
            else:
                cache[case] = build_family_models(root / "family-models", case)
        return cache[case]

    return get


def copy_workflow(src: Path, dest: Path, *, without: tuple[str, ...] = ()) -> Path:
    """A copy of a finished working directory (results, logs and Snakemake's records, with their
    mtimes), less the relative paths in `without` (a stage's outputs and logs, so that it runs
    afresh there). A moved project reruns nothing (test_kill_workflow.py), so the copy plans what
    the original would: the tests that need the tiny workflow's data and base model start from
    one instead of building them again."""
    shutil.copytree(src, dest, symlinks=True)
    for rel in without:
        shutil.rmtree(dest / rel)
    return dest


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The local SLURM cluster (tests/harness/slurm_cluster.py), one per test session: its own
    state in this session's tmp folder, names and subnet, stopped at the end (slurmstepd and a
    job's tasks included). DISTLM_SLURM_STATE names a cluster to use instead (started when it is
    not up, and then stopped at the end; left running when it was up)."""
    from harness import slurm_cluster as sc

    why = sc.missing_requirements()
    if why:
        pytest.skip(why)
    if os.environ.get("DISTLM_SLURM_STATE"):
        c = sc.default_cluster()
        was_up = sc.running(c)
    else:
        c, was_up = sc.session_cluster(tmp_path_factory.mktemp("slurm")), False
    sc.up(c)
    yield c
    if not was_up:
        sc.down(c)


@pytest.fixture(scope="session")
def profile(cluster, tmp_path_factory) -> Path:
    """The test cluster's Snakemake profile (tests/harness/profile.py)."""
    from harness.profile import write_test_profile

    return write_test_profile(tmp_path_factory.mktemp("slurm-profile"))


@pytest.fixture(scope="session")
def slurm_built(tmp_path_factory) -> Path:
    """A work dir whose data and base model exist for the SLURM layout (tiny.yaml and
    tests/harness/slurm-config.yaml), built once (_once_per_run: the two SLURM sessions of
    tests/run.sh share it) with the local profile: the files and Snakemake's records are the
    same whichever profile ran them, and no train setting changes them. The SLURM training tests
    train in copies (tests/slurm_training.py: prepared)."""

    def build(wd: Path) -> None:
        run_snakemake(
            wd, "results/model/base", "results/data/tokens.h5", configfiles=(TINY, SLURM_CONFIG)
        )

    return _once_per_run(tmp_path_factory, "slurm-built", build)


def pytest_configure(config):
    """The slowest tests are listed at the end of every run (CI's time budget is read from it)."""
    if config.option.durations is None:
        config.option.durations = 30


@pytest.fixture
def hub_offline(monkeypatch):
    """The Hugging Face hub switched off as HF_HUB_OFFLINE=1 does, also for modules already
    imported (huggingface_hub reads the variable once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
