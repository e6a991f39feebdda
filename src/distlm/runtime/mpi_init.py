"""Joining the MPI world: what the launcher's PMI and the MPI library can do, checked before MPI_Init.

    from distlm.runtime.mpi_init import init_mpi
    MPI = init_mpi()       # instead of `from mpi4py import MPI`: checks, then MPI_Init_thread

A rank joins its world inside MPI_Init, through the launcher's PMI server (srun's slurmstepd,
mpiexec's proxy). A failure there happens in C, where Python cannot catch it: it aborts with the
MPI library's error stack, or worse deep inside a network library. So what can be checked is
checked before MPI_Init, from the environment the launcher gave the rank and the MPI library's
version (mpi4py can ask for it before MPI_Init), and a launch that cannot work fails with an
MPILaunchError that names the launcher's PMI and the versions:
  * srun started several tasks without a PMI plugin (--mpi=none, MpiDefault=none): every rank
    would be an MPI world of one;
  * srun --mpi=pmix, or MPIR_CVAR_PMI_VERSION=2 or x, with the mpich pip wheel: its MPI layer
    speaks PMI-1 only (MPI_Init fails with "Internal MPI error");
  * mpich 5's UCX netmod chosen explicitly under slurmstepd's PMI (below).
After MPI_Init the world's size must be the number of tasks the launcher started.

slurmstepd's PMI and mpich 5's UCX netmod (issue #42). Under `srun --mpi=pmi2` mpich (PMI-1)
talks to the PMI-1 side of Slurm's pmi2 plugin, which reads each request with one read() of 1024
bytes (Slurm 22.05 src/plugins/mpi/pmi2/pmi1.c, handle_pmi1_cmd: "TODO: read until newline")
although it lets values be 1024 bytes long (get_maxes: vallen_max=1024). A longer request is cut:
slurmstepd stores the first part without its value ("value not properly terminated in client
request") and rejects the rest ("request not begin with 'cmd='", "invalid client request"). The
UCX netmod of mpich 5 publishes 4096 bytes per node for its address (MPID_MAX_BC_SIZE: the UCX
worker address and whatever follows it in the heap), as eight 511-byte segments whose hex
encoding (zero runs compressed) makes put requests of up to 1077 bytes, by the heap's contents
of that run (the longest of a run: 792 to 1006 bytes on the test cluster, 18 bytes short of the
cut; benchmarks/slurm/pmi-results.json). When one is cut, a node's address is lost; mpich's
node-roots exchange returns success on the failed PMI get and gives the unset buffer to UCX,
which aborts ("address.c: Assertion `*addr_version == UCP_OBJECT_VERSION_V2' failed: addr
version N"), or a rank waits for ever for the reply to a request slurmstepd dropped. The OFI
netmod publishes the address itself (16 bytes over TCP): its requests stay near 100 bytes, so
under slurmstepd's PMI distlm sets MPIR_CVAR_CH4_NETMOD=ofi unless the user chose a netmod, and
refuses ucx with mpich 5 or later there. A user's ucx with mpich 4 is kept: it publishes the UCX
address itself (463-byte requests here), whose length only a fabric with many devices can push
past the cut.
docs/slurm.md ("MPI and PMI under srun") says the same for users.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from distlm import DistlmError
from distlm.core.log import get_logger

log = get_logger(__name__)

NETMOD_VAR = "MPIR_CVAR_CH4_NETMOD"
PMI_VERSION_VAR = "MPIR_CVAR_PMI_VERSION"
SLURM_PMI_READ = 1024  # bytes slurmstepd's pmi2 plugin reads per PMI-1 request


class MPILaunchError(DistlmError):
    """This rank cannot join its MPI world as launched; the message says why and what to change."""


@dataclass(frozen=True)
class Launch:
    """Who started this process and which PMI server it talks to.

    launcher: "srun", "mpiexec" or "" (a plain process); pmi: "slurm-pmi2" (slurmstepd's pmi2
    plugin, which mpich reaches with PMI-1), "slurm-pmix", "mpiexec" (Hydra's proxy), or "" (none);
    tasks: how many processes the launcher started (None when it does not say).
    """

    launcher: str
    pmi: str
    tasks: int | None
    rank: int | None

    def describe(self) -> str:
        return {
            "slurm-pmi2": "PMI-1 from slurmstepd (srun --mpi=pmi2)",
            "slurm-pmix": "PMIx from slurmstepd (srun --mpi=pmix)",
            "mpiexec": "PMI from mpiexec's proxy",
            "": f"no PMI ({self.launcher or 'no launcher'})",
        }.get(self.pmi, self.pmi)


@dataclass(frozen=True)
class Library:
    """The MPI library mpi4py loaded: name ("MPICH", "Open MPI"), version, build line (device)."""

    name: str
    version: str
    device: str
    mpi4py: str

    @property
    def major(self) -> int:
        m = re.match(r"(\d+)", self.version)
        return int(m.group(1)) if m else 0

    @property
    def pip_mpich(self) -> bool:
        """The mpich wheel from PyPI (PMI-1 only in its MPI layer: no PMI-2, no PMIx)."""
        if self.name != "MPICH":
            return False
        try:
            return metadata.version("mpich") == self.version
        except metadata.PackageNotFoundError:
            return False

    def describe(self) -> str:
        pip = " (pip wheel)" if self.pip_mpich else ""
        dev = f", {self.device}" if self.device else ""
        return f"{self.name} {self.version}{pip}{dev}, mpi4py {self.mpi4py}"


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def detect_launch(env: Mapping[str, str]) -> Launch:
    """The launcher and PMI server of a process with environment `env`."""
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    mpi_type = env.get("SLURM_MPI_TYPE", "")
    hydra = "MPI_LOCALNRANKS" in env or "PMI_PORT" in env  # Hydra's proxy sets them, srun not
    pmi_vars = "PMI_FD" in env or "PMI_PORT" in env or "PMI_RANK" in env
    if "PMIX_NAMESPACE" in env or "PMIX_RANK" in env:
        pmi = "slurm-pmix" if mpi_type.startswith("pmix") else "pmix"
    elif pmi_vars and hydra:
        pmi = "mpiexec"
    elif pmi_vars and mpi_type == "pmi2":
        pmi = "slurm-pmi2"
    elif pmi_vars:
        pmi = "pmi"
    else:
        pmi = ""
    launcher = "mpiexec" if pmi == "mpiexec" else "srun" if in_step else ""
    if launcher == "srun":
        tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        rank = _int(env, "SLURM_PROCID")
    else:
        tasks = _int(env, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
        rank = _int(env, "PMI_RANK", "OMPI_COMM_WORLD_RANK")
    return Launch(launcher, pmi, tasks, rank)


def library_of(mpi: Any) -> Library:
    """The MPI library behind mpi4py's MPI module (callable before MPI_Init)."""
    import mpi4py

    lines = mpi.Get_library_version().splitlines()
    first = lines[0] if lines else ""
    m = re.match(r"\s*(MPICH|Open MPI|Intel\(R\) MPI Library)\D*([\d.]+\w*)", first)
    name, version = (m.group(1), m.group(2)) if m else (first.strip() or "unknown MPI", "?")
    device = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("MPICH Device")), "")
    return Library(name, version, f"device {device}" if device else "", mpi4py.__version__)


@functools.cache
def slurm_version() -> str:
    """`srun --version` (for messages only; "" when srun is not on PATH)."""
    try:
        out = subprocess.run(
            ["srun", "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _versions(launch: Launch, lib: Library) -> str:
    slurm = slurm_version() if launch.launcher == "srun" else ""
    return f"{lib.describe()}; {launch.describe()}" + (f", {slurm}" if slurm else "")


def prepare(env: MutableMapping[str, str], launch: Launch, lib: Library) -> dict[str, str]:
    """Check that this rank can join its world; set what MPI_Init must read. Returns the variables
    set (name -> value); raises MPILaunchError for a launch that cannot work."""
    where = _versions(launch, lib)
    if launch.launcher == "srun" and launch.pmi == "" and (launch.tasks or 1) > 1:
        raise MPILaunchError(
            f"MPI: srun started {launch.tasks} tasks without a PMI plugin (--mpi=none, or no "
            f"--mpi and MpiDefault=none): each would be an MPI world of one. Launch with "
            f"`srun --mpi=pmi2` (profiles/slurm/config.yaml: the rule's `mpi` resource). [{where}]"
        )
    if lib.pip_mpich:
        chosen = env.get(PMI_VERSION_VAR, "").strip().lower()
        if launch.pmi in ("slurm-pmix", "pmix") or chosen in ("2", "x"):
            what = f"{PMI_VERSION_VAR}={chosen}" if chosen in ("2", "x") else "a PMIx launch"
            raise MPILaunchError(
                f"MPI: {what}, but the mpich pip wheel speaks only PMI-1 (its MPI_Init fails "
                f"with 'Internal MPI error'): launch with `srun --mpi=pmi2` or mpiexec and leave "
                f"{PMI_VERSION_VAR} unset. [{where}]"
            )
    changed: dict[str, str] = {}
    if launch.pmi == "slurm-pmi2" and lib.name == "MPICH":
        netmod = env.get(NETMOD_VAR, "").strip().lower()
        if not netmod:
            changed[NETMOD_VAR] = env[NETMOD_VAR] = "ofi"
        elif netmod == "ucx" and lib.major >= 5:
            raise MPILaunchError(
                f"MPI: {NETMOD_VAR}=ucx under srun --mpi=pmi2: mpich {lib.version} publishes "
                f"4096 bytes per node for a UCX address, PMI-1 requests of up to 1077 bytes, and "
                f"slurmstepd reads {SLURM_PMI_READ} bytes per request: a longer one is cut, a "
                f"node's address lost and UCX aborts (issue #42). Leave {NETMOD_VAR} unset (distlm "
                f"then uses ofi) or launch with mpiexec. [{where}]"
            )
    return changed


def init_mpi() -> Any:
    """mpi4py's MPI module with MPI initialised (thread level: mpi4py.rc's), after the checks
    above; a process that already imported mpi4py.MPI gets that module unchecked."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    import mpi4py

    # rc is read when mpi4py.MPI is imported: initialise ourselves, after the checks, and let
    # mpi4py finalise at exit as it does when it initialises (rc.finalize None follows initialize)
    level = mpi4py.rc.thread_level
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    from mpi4py import MPI

    launch = detect_launch(os.environ)
    lib = library_of(MPI)
    try:
        changed = prepare(os.environ, launch, lib)
    except MPILaunchError as e:
        _say(e)
        raise
    if launch.rank in (0, None) and launch.pmi:
        extra = ", ".join(f"{k}={v}" for k, v in changed.items())
        log.info("MPI: %s%s", _versions(launch, lib), f"; set {extra}" if extra else "")
    required = {
        "single": MPI.THREAD_SINGLE,
        "funneled": MPI.THREAD_FUNNELED,
        "serialized": MPI.THREAD_SERIALIZED,
    }.get(level, MPI.THREAD_MULTIPLE)
    if not MPI.Is_initialized():
        MPI.Init_thread(required)
    size = MPI.COMM_WORLD.Get_size()
    if launch.tasks is not None and size != launch.tasks:
        e = MPILaunchError(
            f"MPI: {launch.launcher or 'the launcher'} started {launch.tasks} processes but this "
            f"one joined a world of {size}. [{_versions(launch, lib)}]"
        )
        _say(e)
        raise e
    return MPI


def _say(e: MPILaunchError) -> None:
    """The reason, logged in one write before it is raised: srun ends a step once a task fails
    and can drop the rest of that task's output (on the loaded test cluster only the first line
    of the traceback came through), so the line that says why goes first."""
    log.error("%s", e)
