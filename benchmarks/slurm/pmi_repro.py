"""Issue #42: the SLURM multi-node inference step, many times, under CPU load; how often it fails.

    python tests/harness/slurm_cluster.py up --nodes 2
    eval "$(python tests/harness/slurm_cluster.py env)"
    python benchmarks/slurm/pmi_repro.py --runs 30 --load 4 --label mpich-5.0.2
    python benchmarks/slurm/pmi_repro.py --runs 30 --load 4 --python /tmp/venv432/bin/python \
        --label mpich-4.3.2          # a venv with mpich==4.3.2, mpi4py and distlm (see below)
    python benchmarks/slurm/pmi_repro.py --runs 10 --inject --program init --netmod ucx \
        --label injected-ucx         # the worst case on demand (below), as before the fix
    python tests/harness/slurm_cluster.py down

Each run is one `srun --mpi=pmi2 -N2 -n3 <python> -m distlm.entry.infer` on a 3-stage tiny model
(the workflow's inference step, one rank per stage, across the cluster's two nodes), or with
`--program init` a bare mpi4py program that only joins the world and sends a message to every
rank (MPI_Init's address exchange is the same for both; distlm's own start-up checks are skipped).
`--load N` keeps N busy-loop processes on the machine for the whole measurement. A run is:
  ok          exit 0 (infer: a generation per prompt; init: every rank reported);
  ucx-abort   the UCX address assertion (address.c, "addr version N") or a failed UCX call in
              MPICH's address exchange;
  hang        still running after --timeout (a request lost with its reply: the rank waits);
  other       anything else (the output's tail is kept in the JSON).
and, apart from how it ended, whether slurmstepd rejected a PMI request ("value not properly
terminated", "request not begin with 'cmd='"): its PMI-1 reader got a request cut at 1024 bytes.
Every rank traces its PMI client (PMI_DEBUG=1), so each run also gives its longest PMI-1 request
in bytes: slurmstepd reads one request with a single read() of 1024 bytes (Slurm 22.05
src/plugins/mpi/pmi2/pmi1.c, handle_pmi1_cmd, "TODO: read until newline").

--inject preloads tests/harness/ucx_heap_pad.c (compiled here with cc), which makes the bytes after the UCX worker address
non-zero: mpich 5 sends 4096 bytes from that address through PMI (MPID_MAX_BC_SIZE), whatever
follows the address in the heap; non-zero bytes hex-encode without run-length compression, so
every 511-byte segment becomes a PMI-1 put of about 1077 bytes, the case that reached the issue's
test run. With mpich 4 (the real address only) or the OFI netmod (a 16-byte address) it changes
nothing.

The 4.3.2 venv: python -m venv --system-site-packages /tmp/venv432 &&
/tmp/venv432/bin/pip install --force-reinstall mpich==4.3.2 mpi4py (torch and distlm come from the
system site-packages). Results are added to --out (one entry per --label, replaced when rerun).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLURM_READ = 1024  # bytes slurmstepd reads per PMI-1 request (pmi1.c MAX_READLINE)

INIT_PROGRAM = """
import socket
from mpi4py import MPI
c = MPI.COMM_WORLD
for p in range(c.size):  # a message to and from every rank: each peer's address is used
    if p != c.rank:
        c.sendrecv(c.rank, dest=p, source=p)
print("joined", c.rank, c.size, socket.gethostname(), flush=True)
"""

SHIM = ROOT / "tests" / "harness" / "ucx_heap_pad.c"  # the fault injection, with its reasons


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--load", type=int, default=4, help="busy-loop processes beside the runs")
    p.add_argument("--python", default=sys.executable, help="the ranks' interpreter (its mpich)")
    p.add_argument("--program", choices=("infer", "init"), default="infer")
    p.add_argument(
        "--netmod", default="", help="MPIR_CVAR_CH4_NETMOD for the ranks ('' leaves it unset)"
    )
    p.add_argument("--inject", action="store_true", help="non-zero bytes after the UCX address")
    p.add_argument("--timeout", type=float, default=240, help="seconds before a run is a hang")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "distlm-pmi-repro"))
    p.add_argument("--label", required=True, help="this measurement's key in --out")
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--out", default=str(Path(__file__).parent / "pmi-results.json"))
    return p.parse_args()


def tiny_model(work: Path) -> tuple[Path, Path]:
    """The test suite's 3-stage tiny model (tests/test_inference.py) and its inference config."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_inference import build_tiny_models, write_config

    model = build_tiny_models(work / "models")[3]
    cfg = write_config(work / "inference.json", stages=3, max_new_tokens=8)
    return model, cfg


def versions(python: str) -> dict[str, str]:
    code = (
        "import json, mpi4py\nfrom mpi4py import rc\nrc.initialize = False\n"
        "from mpi4py import MPI\nv = MPI.Get_library_version().splitlines()\n"
        "print(json.dumps({'mpi': v[0].split(':', 1)[1].strip(), 'mpi_device': "
        "[x for x in v if 'Device' in x][0].split(':', 1)[1].strip(), "
        "'mpi4py': mpi4py.__version__}))"
    )
    out = json.loads(
        subprocess.run([python, "-c", code], capture_output=True, text=True, check=False).stdout
    )
    srun = subprocess.run(
        ["srun", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {**out, "slurm": srun}


def classify(rc: int | None, out: str, program: str, gen: Path) -> str:
    """How the run ended: ok, ucx-abort, hang or other."""
    if re.search(r"addr_version|address\.c:\d+ Assertion|ucx function returned with failed", out):
        return "ucx-abort"
    if rc is None:
        return "hang"
    if rc == 0 and program == "init" and len(re.findall(r"^joined ", out, re.MULTILINE)) == 3:
        return "ok"
    if rc == 0 and program == "infer" and gen.is_file() and gen.read_text().strip():
        return "ok"
    return "other"


def pmi_split(out: str) -> bool:
    """slurmstepd rejected a PMI-1 request cut at its 1024-byte read."""
    return bool(re.search(r"mpi/pmi2: (value not properly terminated|request not begin)", out))


def longest_request(out: str) -> int | None:
    """Bytes of the longest PMI-1 put the ranks sent (their PMI_DEBUG trace), newline included."""
    sizes = [len(m) + 1 for m in re.findall(r"pmi: (cmd=put [^\n]*)", out)]
    return max(sizes) if sizes else None


def main() -> None:
    args = parse()
    if not os.environ.get("SLURM_CONF"):
        sys.exit('no SLURM_CONF: eval "$(python tests/harness/slurm_cluster.py env)" first')
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env_extra = {"PMI_DEBUG": "1", "OMP_NUM_THREADS": "1"}
    if args.netmod:
        env_extra["MPIR_CVAR_CH4_NETMOD"] = args.netmod
    if args.inject:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            sys.exit("--inject needs a C compiler (cc)")
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", work / "ucxpad.so", SHIM, "-ldl"], check=True
        )
        env_extra["LD_PRELOAD"] = str(work / "ucxpad.so")
    gen = work / "generations.jsonl"
    if args.program == "infer":
        model, cfg = tiny_model(work)
        prog = [
            "-m", "distlm.entry.infer", "--config", str(cfg), "--model", str(model),
            "--prompts", str(ROOT / "config" / "prompts.txt"), "--generations", str(gen),
            "--timing", str(work / "timing.json"),
        ]  # fmt: skip
    else:
        (work / "init.py").write_text(INIT_PROGRAM)
        prog = [str(work / "init.py")]
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in env_extra.items())])
    cmd = ["srun", "--mpi=pmi2", "-N2", "-n3", f"--export={export}", args.python, *prog]
    vers = versions(args.python)
    print(f"{args.label}: {vers}\n  {' '.join(cmd)}", flush=True)

    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    kinds: dict[str, int] = {}
    split = 0
    longest: list[int] = []
    samples: list[dict] = []
    try:
        for i in range(args.runs):
            gen.unlink(missing_ok=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",  # slurmstepd echoes a cut request: any bytes
            )
            try:
                out, _ = proc.communicate(timeout=args.timeout)
                rc: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                proc.kill()  # srun's kill ends the step on both nodes
                out, _ = proc.communicate()
                rc = None
            kind = classify(rc, out, args.program, gen)
            kinds[kind] = kinds.get(kind, 0) + 1
            split += pmi_split(out)
            size = longest_request(out)
            if size is not None:
                longest.append(size)
            print(f"  run {i + 1}: {kind}{' after a PMI split' * pmi_split(out)} ({time.monotonic() - t0:.0f} s, longest PMI-1 request "
                  f"{size} bytes)", flush=True)  # fmt: skip
            if kind != "ok" and len(samples) < 3:
                lines = [
                    x for x in out.splitlines() if "pmi: " not in x and "pmi response" not in x
                ]
                samples.append({"run": i + 1, "kind": kind, "rc": rc, "tail": lines[-25:]})
    finally:
        for p in load:
            p.kill()
            p.wait()

    failures = args.runs - kinds.get("ok", 0)
    row = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "versions": vers,
        "program": args.program,
        "netmod": args.netmod or "(unset: distlm decides; mpich's default is ucx)",
        "inject": args.inject,
        "runs": args.runs,
        "failures": failures,
        "failure_rate": round(failures / args.runs, 3),
        "kinds": kinds,
        "runs_with_pmi_split": split,
        "load": f"{args.load} busy-loop processes on {os.cpu_count()} cores",
        "longest_pmi1_request_bytes": (
            {"min": min(longest), "median": statistics.median(longest), "max": max(longest)}
            if longest
            else None
        ),
        "slurm_read_bytes": SLURM_READ,
        "command": " ".join(cmd),
        "note": args.note,
        "failed_samples": samples,
    }
    out_path = Path(args.out)
    data = json.loads(out_path.read_text()) if out_path.is_file() else {}
    data[args.label] = row
    out_path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{args.label}: {failures}/{args.runs} failed {kinds} -> {out_path}")


if __name__ == "__main__":
    main()
