"""Repository checks: every benchmark script starts, and the conda envs' pins agree with
pyproject.toml and CI."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_SCRIPTS = sorted(p.relative_to(ROOT) for p in (ROOT / "benchmarks").rglob("*.py"))
ENVS = sorted((ROOT / "workflow" / "envs").glob("*.yaml"))


def test_there_are_benchmark_scripts_and_envs():
    assert len(BENCHMARK_SCRIPTS) >= 7, BENCHMARK_SCRIPTS
    assert len(ENVS) >= 5, ENVS


@pytest.fixture(scope="module")
def helps() -> dict[Path, subprocess.CompletedProcess]:
    """`python <script> --help` of every benchmark script, all started at once (seconds each)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    procs = {
        script: subprocess.Popen(
            [sys.executable, str(script), "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in BENCHMARK_SCRIPTS
    }
    out = {}
    for script, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[script] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("script", BENCHMARK_SCRIPTS, ids=str)
def test_benchmark_script_starts(script, helps):
    """`python <script> --help` exits 0: its imports resolve and its arguments parse."""
    r = helps[script]
    assert r.returncode == 0, f"{script} --help exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert "usage:" in r.stdout, f"{script} --help printed no usage:\n{r.stdout[-2000:]}"


def _pyproject_requirements() -> dict[str, SpecifierSet]:
    """Package name -> the specifiers pyproject.toml puts on it (dependencies and every extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    out: dict[str, SpecifierSet] = {"python": SpecifierSet(project["requires-python"])}
    for line in reqs:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def _env_pins(path: Path) -> dict[str, str]:
    """Package name -> pinned version in a conda env file: conda `name=ver` and pip `name==ver`."""
    doc = yaml.safe_load(path.read_text())
    pins: dict[str, str] = {}
    for dep in doc["dependencies"]:
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                if line.startswith("-"):  # -e ../.. (distlm itself)
                    continue
                req = Requirement(line)
                specs = list(req.specifier)
                assert len(specs) == 1 and specs[0].operator == "==", (
                    f"{path.name}: pip dependency {line!r} is not pinned with =="
                )
                pins[canonicalize_name(req.name)] = specs[0].version
        else:
            name, sep, version = str(dep).partition("=")
            assert sep and version and not version.startswith("="), (
                f"{path.name}: conda dependency {dep!r} is not pinned as name=version"
            )
            pins[canonicalize_name(name)] = version
    return pins


def _ci_torch() -> str:
    """The torch build CI installs (.ci/run), the one the test command runs with."""
    m = re.search(r"\btorch==([0-9][0-9.]*)", (ROOT / ".ci" / "run").read_text())
    assert m, ".ci/run pins no torch==VERSION"
    return m.group(1)


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_env_pins_agree_with_pyproject(env):
    """Every package an env pins and pyproject.toml declares: the pin satisfies pyproject's
    specifier; torch is the version CI tests (.ci/run)."""
    declared = _pyproject_requirements()
    pins = _env_pins(env)
    checked = 0
    for name, version in pins.items():
        if name in declared:
            checked += 1
            assert Version(version) in declared[name], (
                f"{env.name}: {name} {version} does not satisfy pyproject.toml's "
                f"{name}{declared[name]}"
            )
    assert checked >= 3, f"{env.name}: pins {sorted(pins)}, few of them declared in pyproject.toml"
    if "torch" in pins:
        assert pins["torch"] == _ci_torch(), (
            f"{env.name}: torch {pins['torch']}, but CI (.ci/run) tests torch {_ci_torch()}"
        )


def test_envs_pin_one_version_of_each_package():
    """A package pinned in several envs has the same version in all of them."""
    seen: dict[str, tuple[str, str]] = {}
    for env in ENVS:
        for name, version in _env_pins(env).items():
            first = seen.setdefault(name, (version, env.name))
            assert first[0] == version, (
                f"{name}: {env.name} pins {version}, {first[1]} pins {first[0]}"
            )


def _constraints() -> dict[str, str]:
    """Package name -> version pinned in constraints.txt (name==version lines)."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"constraints.txt: {line!r}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"constraints.txt pins {name} twice"
        pins[name] = specs[0].version
    return pins


def test_the_constraints_are_what_ci_installs_and_satisfy_pyproject():
    """constraints.txt (the set CI passed with) pins every package the install declares, torch
    left to the user's build: each pin satisfies pyproject.toml, and .ci/run and the README's
    set-up install with it."""
    pins = _constraints()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = [
        Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]
    ]
    declared = _pyproject_requirements()
    for req in installed:
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker is not None and not req.marker.evaluate()):
            continue
        assert name in pins, f"constraints.txt does not pin {name} (pyproject.toml needs it)"
        assert Version(pins[name]) in declared[name], (
            f"constraints.txt: {name} {pins[name]} does not satisfy pyproject.toml's "
            f"{name}{declared[name]}"
        )
    assert "torch" not in pins and not any(n.startswith("nvidia-") for n in pins)
    install = "-c constraints.txt torch=="
    assert install in (ROOT / ".ci" / "run").read_text()
    assert install in (ROOT / "README.md").read_text()


def test_the_gpu_check_plans_every_figure_in_calls_of_nine_minutes(tmp_path):
    """benchmarks/gpu/run.sh's default call, dry (every step written down, none run: the same
    script, helpers and commands a GPU machine runs): the steps in order, the figures never
    measured since the model's rewrite first (training, then serving), then correctness; each
    with a limit, sharing a budget of at most 9 minutes; every figure asked for; what it cannot
    run written down with why; no target after an option that takes several values."""
    import json

    from test_docs import snakemake_args

    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "GPU_WORK": str(tmp_path / "work")}
    done = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", str(tmp_path / "wheels")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    planned = [s["step"] for s in summary["steps"] if s.get("why") == "dry run"]
    serving = ["serve", "serve-profile", "serve-update"]
    figures = ["train", "train-smollm2", "train-fsdp", *serving, "infer"]
    assert planned == ["install", *figures, "workflow", "tests"]
    assert steps["uccl"]["why"].startswith("no uccl wheel")
    assert steps["extra"]["why"].startswith("not asked for")
    budget = int(re.search(r"BUDGET_S:-(\d+)", (ROOT / "benchmarks/gpu/run.sh").read_text())[1])
    assert budget <= 9 * 60 and all(steps[s]["limit"] <= budget for s in planned)
    serve = steps["serve"]["command"]
    assert (
        serve[serve.index("--repeats") + 1] == "2"
        and float(serve[serve.index("--seconds") + 1]) >= 10
    )
    assert "256" in serve[serve.index("--clients") + 1].split(",")  # #63: 256 clients on a GPU
    assert len(serve[serve.index("--api-servers") + 1].split(",")) >= 2
    for s in summary["steps"]:
        argv = s["command"]
        if "snakemake" in argv:
            parsed = snakemake_args(tuple(argv[argv.index("snakemake") + 1 :]))
            assert all(c.endswith((".yaml", ".yml", ".json")) for c in parsed.configfiles), argv
