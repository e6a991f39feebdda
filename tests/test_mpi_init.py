"""Joining the MPI world (distlm.runtime.mpi_init, issue #42): the checks before MPI_Init, and the SLURM
multi-node inference step with the heap contents that made mpich 5's UCX netmod abort under
`srun --mpi=pmi2`.

The unit tests give distlm.runtime.mpi_init environments as srun, mpiexec or nothing would; the SLURM tests
(marked slurm, the session cluster of tests/conftest.py) run real steps across the two nodes, the
regression one with tests/harness/ucx_heap_pad.c preloaded: every PMI-1 request mpich 5's UCX
netmod makes for its address is then longer than the 1024 bytes slurmstepd reads, so without
distlm's choice of the OFI netmod a node's address is lost and the step aborts in UCX or hangs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import test_inference
from conftest import ROOT
from test_inference import write_config

from distlm.runtime.mpi_init import (
    NETMOD_VAR,
    Launch,
    Library,
    MPILaunchError,
    detect_launch,
    prepare,
)

tiny_models = test_inference.tiny_models  # the session fixture: tiny model folders per stage count

SRUN_PMI2 = {  # what srun --mpi=pmi2 -N2 -n3 gives task 0 (and the rest of a SLURM step)
    "SLURM_STEP_ID": "0",
    "SLURM_MPI_TYPE": "pmi2",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_PROCID": "0",
    "PMI_FD": "11",
    "PMI_RANK": "0",
    "PMI_SIZE": "3",
    "PMI_JOBID": "5.0",
}
HYDRA = {"PMI_FD": "9", "PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}
MPICH5 = Library("MPICH", "5.0.2", "device ch4:ucx ofi", "4.1.2")
MPICH4 = Library("MPICH", "4.3.2", "device ch4:ucx ofi", "4.1.2")


def test_srun_pmi2_is_slurmstepds_pmi_and_mpiexec_is_hydras():
    assert detect_launch(SRUN_PMI2) == Launch("srun", "slurm-pmi2", 3, 0)
    # Hydra's ranks inside a SLURM job keep the job's variables: Hydra's own ones decide
    assert detect_launch({**HYDRA, "SLURM_STEP_ID": "0"}) == Launch("mpiexec", "mpiexec", 3, 0)
    assert detect_launch({}) == Launch("", "", None, None)


def test_under_slurmstepds_pmi_the_ofi_netmod_is_chosen():
    env = dict(SRUN_PMI2)
    assert prepare(env, detect_launch(env), MPICH5) == {NETMOD_VAR: "ofi"}
    assert env[NETMOD_VAR] == "ofi"
    # a netmod the user chose is kept (ofi, or ucx with mpich 4: it publishes the address only)
    for lib, netmod in ((MPICH5, "ofi"), (MPICH4, "ucx")):
        env = {**SRUN_PMI2, NETMOD_VAR: netmod}
        assert prepare(env, detect_launch(env), lib) == {}
        assert env[NETMOD_VAR] == netmod
    # mpiexec's proxy reads whole requests: mpich's default netmod stays
    env = dict(HYDRA)
    assert prepare(env, detect_launch(env), MPICH5) == {} and NETMOD_VAR not in env


def test_ucx_under_slurmstepds_pmi_with_mpich5_is_refused_with_the_reason_and_versions():
    env = {**SRUN_PMI2, NETMOD_VAR: "ucx"}
    with pytest.raises(MPILaunchError) as e:
        prepare(env, detect_launch(env), MPICH5)
    msg = str(e.value)
    for part in ("MPI", "ucx", "srun --mpi=pmi2", "1024", "MPICH 5.0.2", "mpi4py 4.1.2", "PMI-1"):
        assert part in msg, (part, msg)


def test_srun_without_a_pmi_plugin_is_refused_not_a_world_of_one_per_task():
    env = {k: v for k, v in SRUN_PMI2.items() if not k.startswith("PMI_")}
    env["SLURM_MPI_TYPE"] = "none"
    with pytest.raises(MPILaunchError, match=r"srun started 3 tasks without a PMI plugin"):
        prepare(env, detect_launch(env), MPICH5)
    one = {**env, "SLURM_STEP_NUM_TASKS": "1"}  # one task (the jobstep's srun -n1): a world of one
    assert prepare(one, detect_launch(one), MPICH5) == {}


def test_a_refused_launch_says_why_in_its_first_line():
    """srun ends a step once a task fails and can drop the rest of that task's output (CI: only
    "Traceback (most recent call last):" came through): the reason is the process's first write."""
    env = {k: v for k, v in SRUN_PMI2.items() if not k.startswith("PMI_")}
    env["SLURM_MPI_TYPE"] = "none"
    proc = subprocess.run(
        [sys.executable, "-c", "from distlm.runtime.mpi_init import init_mpi; init_mpi()"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    first = proc.stderr.splitlines()[0]
    assert first.startswith("MPI: srun started 3 tasks without a PMI plugin"), proc.stderr
    assert "MPILaunchError" in proc.stderr  # and the traceback after it


def test_pmi2_or_pmix_with_the_mpich_wheel_is_refused():
    try:
        wheel = Library("MPICH", metadata.version("mpich"), "", "4.1.2")
    except metadata.PackageNotFoundError:
        pytest.skip("no mpich pip wheel installed")
    assert wheel.pip_mpich
    for env in (
        {**SRUN_PMI2, "MPIR_CVAR_PMI_VERSION": "2"},
        {"SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "pmix_v4", "PMIX_NAMESPACE": "slurm.pmix.5.0"},
    ):
        with pytest.raises(MPILaunchError, match="speaks only PMI-1"):
            prepare(env, detect_launch(env), wheel)


# ------------------------------------------------------------------------------ a real cluster


def _mpich_major() -> int:
    try:
        return int(metadata.version("mpich").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


def _srun(cluster, args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["srun", "--mpi=pmi2", "-N2", "-n3", *args],
            capture_output=True,
            text=True,
            errors="replace",  # slurmstepd echoes a cut request: any bytes
            env=cluster.env(),
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        why = f"a rank waits for a PMI reply slurmstepd never sent\n{e.stdout}\n{e.stderr}"
        pytest.fail(f"srun {' '.join(args)} still running after {timeout:.0f} s: {why}")


@pytest.mark.slurm
@pytest.mark.slow
def test_inference_step_across_nodes_survives_incompressible_ucx_heap(
    cluster, tiny_models, tmp_path
):
    """The issue's step (srun --mpi=pmi2, 3 stages over 2 nodes) with the heap contents after the
    UCX address that make mpich 5's PMI-1 requests longer than slurmstepd's 1024-byte read."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for tests/harness/ucx_heap_pad.c")
    shim = tmp_path / "ucx_heap_pad.so"
    src = ROOT / "tests" / "harness" / "ucx_heap_pad.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", shim, src, "-ldl"], check=True)
    cfg = write_config(tmp_path / "inference.json", stages=3, max_new_tokens=4)
    gen = tmp_path / "generations.jsonl"
    proc = _srun(
        cluster,
        [
            f"--export=ALL,LD_PRELOAD={shim},OMP_NUM_THREADS=1",
            sys.executable,
            "-m",
            "distlm.entry.infer",
            "--config",
            str(cfg),
            "--model",
            str(tiny_models[3]),
            "--prompts",
            str(ROOT / "config" / "prompts.txt"),
            "--generations",
            str(gen),
            "--timing",
            str(tmp_path / "timing.json"),
        ],
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "mpi/pmi2:" not in out, out[-6000:]  # slurmstepd rejected no request
    assert gen.read_text().strip(), out[-3000:]  # the pipeline generated


@pytest.mark.slurm
def test_ucx_chosen_under_srun_pmi2_fails_before_mpi_init_with_a_clear_error(cluster):
    if _mpich_major() < 5:
        pytest.skip("mpich < 5 publishes the UCX address only")
    proc = _srun(
        cluster,
        [
            f"--export=ALL,{NETMOD_VAR}=ucx",
            sys.executable,
            "-c",
            "from distlm.runtime.mpi_init import init_mpi; init_mpi()",
        ],
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "MPILaunchError" in out and "slurmstepd reads 1024 bytes" in out, out[-4000:]
    assert "mpi/pmi2:" not in out and "Assertion" not in out, out[-4000:]  # before MPI_Init


@pytest.mark.slurm
def test_srun_without_pmi_fails_with_a_clear_error_instead_of_worlds_of_one(cluster):
    proc = subprocess.run(
        [
            "srun",
            "--mpi=none",
            "-N2",
            "-n2",
            sys.executable,
            "-c",
            "from distlm.runtime.mpi_init import init_mpi; init_mpi()",
        ],
        capture_output=True,
        text=True,
        env=cluster.env(),
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "srun started 2 tasks without a PMI plugin" in proc.stderr, proc.stderr[-3000:]
