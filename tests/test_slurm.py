"""profiles/slurm against a real SLURM cluster (tests/harness/slurm_cluster.py: munged, slurmctld,
two slurmd hosts in their own network namespaces): steps across nodes, MPI through srun, multi-node
torchrun through distlm-launch, the whole tiny workflow with the same results as the local profile,
a failing job reported with its SLURM log, and --forcerun resubmitting one stage and its dependents.

Skips (with the reason) when not root or when slurm-wlm/munge are missing; .ci/slurm-setup installs
them. The cluster and the test profile are tests/conftest.py's session fixtures (`cluster`,
`profile`): one cluster of this session's own, started once for every SLURM test.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_inference
from conftest import ROOT, SLURM_CONFIG, TINY, run_snakemake
from test_inference import write_config

from distlm.broadcast.documents import BroadcastReport
from distlm.core.documents import read_document
from distlm.runtime.dist import free_port

pytestmark = pytest.mark.slurm
HARNESS = ROOT / "tests" / "harness"
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)")
tiny_models = (
    test_inference.tiny_models
)  # the session fixture: tiny model folders, one per stage count


def sh(cluster, cmd: list[str], *, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=cluster.env(),
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def slurm_jobs(output: str) -> list[dict]:
    """Snakemake's output -> one dict per submitted job: rule, its log, SLURM job id and log."""
    blocks = {}
    for m in re.finditer(r"^(?:local)?rule (\w+):\n(.*?)(?=^\S)", output, re.DOTALL | re.MULTILINE):
        jobid = re.search(r"^\s+jobid: (\d+)$", m.group(2), re.MULTILINE)
        log = re.search(r"^\s+log: (\S+)$", m.group(2), re.MULTILINE)
        if jobid:
            blocks[jobid.group(1)] = (m.group(1), log.group(1) if log else None)
    jobs = []
    for jobid, slurm_id, slurm_log in SUBMITTED.findall(output):
        rule, log = blocks[jobid]
        jobs.append({"rule": rule, "log": log, "slurm_id": slurm_id, "slurm_log": slurm_log})
    return jobs


def submissions(output: str) -> dict[str, list[str]]:
    """{rule: [SLURM job ids]} for every job Snakemake submitted."""
    out: dict[str, list[str]] = {}
    for job in slurm_jobs(output):
        out.setdefault(job["rule"], []).append(job["slurm_id"])
    return out


def job_fields(cluster, job_id: str) -> dict[str, str]:
    text = sh(cluster, ["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", text))


# --- the cluster itself --------------------------------------------------------------------------


def test_nodes_are_hosts_with_their_own_names_and_addresses(cluster):
    out = sh(
        cluster,
        ["srun", "-N2", "-n2", "-l", "sh", "-c", "echo $(hostname) $(hostname -I) $SLURM_NODEID"],
    ).stdout
    rows = sorted(line.split(": ", 1)[1].split() for line in out.splitlines())
    assert rows == [["node1", cluster.node_addr(1), "0"], ["node2", cluster.node_addr(2), "1"]]


def test_mpi_through_srun_pmi2_crosses_nodes(cluster):
    out = sh(
        cluster, ["srun", "--mpi=pmi2", "-N2", "-n3", sys.executable, str(HARNESS / "mpi_check.py")]
    ).stdout
    got = json.loads(out)
    assert got["size"] == 3 and got["sum"] == 6
    assert sorted(set(got["hosts"])) == ["node1", "node2"] and got["from_last"] == got["hosts"][2]
    # Without a PMI plugin every mpich rank is a world of its own: why the profile says pmi2.
    alone = sh(
        cluster, ["srun", "--mpi=none", "-N2", "-n2", sys.executable, str(HARNESS / "mpi_check.py")]
    ).stdout
    assert [json.loads(line)["size"] for line in alone.splitlines()] == [1, 1]


def _sbatch_launch(cluster, tmp_path: Path, name: str, launch: str, extra: str) -> subprocess.Popen:
    """distlm-launch in a 2-node batch job whose SLURM_* are cleared as Snakemake's jobstep does."""
    script = tmp_path / f"{name}.sh"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        for v in $(env | grep -o '^SLURM_[A-Z_]*'); do [ $v = SLURM_JOB_ID ] || unset $v; done
        exec {sys.executable} -m distlm.launch srun-torchrun {launch} \\
            {HARNESS / "ddp_check.py"} {tmp_path / name}.json {extra}
        """)
    )
    return subprocess.Popen(
        [
            "sbatch",
            "-W",
            "-N2",
            "-n2",
            "-c1",
            "--mem=1500",
            "-t",
            "5",
            f"--output={tmp_path / name}.log",
            f"-D{tmp_path}",
            str(script),
        ],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_distlm_launch_torchrun_across_nodes_and_a_dead_rank_ends_the_job(cluster, tmp_path):
    # 3 processes spread over 2 nodes (2 + 1): torchrun agents with different local world sizes
    ok = _sbatch_launch(cluster, tmp_path, "ok", "--spread-procs --nproc-per-node=3", "")
    # 1 process per node; rank 1 (on the other node) dies before the collective
    bad = _sbatch_launch(cluster, tmp_path, "bad", "--nproc-per-node=1", "--fail-rank 1")
    ok_rc, bad_rc = ok.wait(timeout=240), bad.wait(timeout=240)
    log = (tmp_path / "ok.log").read_text()
    assert ok_rc == 0, log
    assert (
        "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in log and "--rdzv-endpoint=node1:" in log
    )
    got = json.loads((tmp_path / "ok.json").read_text())
    assert got["world_size"] == 3 and got["sum"] == 6.0
    assert sorted(h for h, _ in got["hosts"]) == ["node1", "node1", "node2"]
    assert {m for _, m in got["hosts"]} == {"node1"}  # MASTER_ADDR: the first node
    bad_log = (tmp_path / "bad.log").read_text()
    assert bad_rc != 0, bad_log
    assert "rank 1 fails on purpose" in bad_log and not (tmp_path / "bad.json").exists()


def test_serve_front_under_srun_answers_503_when_a_stage_is_killed(cluster, tiny_models, tmp_path):
    # what `snakemake --profile profiles/slurm serve` runs: the API server in the batch script,
    # the pipeline's 3 ranks through srun over 2 nodes (stage 0 on the batch host, talking to the
    # API server over IPC); stage 1 (on the batch host) is killed mid-request
    port = free_port()
    cfg = write_config(
        tmp_path / "cfg.json", stages=3, lanes=4, timeout_s=120, serve={"port": port}
    )
    log = tmp_path / "serve.log"
    script = HARNESS / "serve_killed_stage.py"
    sh(
        cluster,
        [
            "sbatch",
            "-W",
            "-N2",
            "-n3",
            "-c1",
            "--mem=1500",
            "-t",
            "5",
            f"--output={log}",
            f"-D{tmp_path}",
            f"--wrap=OMP_NUM_THREADS=1 {sys.executable} {script} {cfg} {tiny_models[3]} {port}",
        ],
        timeout=300,
    )
    text = log.read_text()
    lines = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1]
        for ln in text.splitlines()
        if ln.split(" ", 1)[0] in ("HEALTH", "COMPLETION", "AFTER_KILL", "FRONT_RC")
    }
    assert lines.keys() == {"HEALTH", "COMPLETION", "AFTER_KILL", "FRONT_RC"}, text[-3000:]
    assert {h for _, h, _ in json.loads(lines["HEALTH"])} == {"node1", "node2"}, text[-3000:]
    assert lines["COMPLETION"] == "200", text[-3000:]
    seconds, status, body = json.loads(lines["AFTER_KILL"])
    assert status == 503 and seconds < 30, text[-3000:]  # timeout_s is 120: not stage 0's deadline
    assert "the pipeline job ended (exit code" in json.loads(body)["error"]["message"]
    assert lines["FRONT_RC"] != "0", text[-3000:]


# --- the workflow through the profile ------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_run(cluster, profile, tmp_path_factory):
    wd = tmp_path_factory.mktemp("slurm-workflow")
    proc = run_snakemake(
        wd, configfiles=(TINY, SLURM_CONFIG), profile=profile, env=cluster.env_changes()
    )
    return wd, proc.stdout + proc.stderr


def _multi_process_rules() -> dict[str, str]:
    """Rules whose shell starts several processes: rule -> launcher resource (a torchrun stage's
    shell is common.smk's torchrun_shell, which starts with `{resources.torchrun}`)."""
    found = {}
    for smk in (ROOT / "workflow" / "rules").glob("*.smk"):
        for m in re.finditer(
            r"^rule (\w+):(.*?)(?=^rule |\Z)", smk.read_text(), re.DOTALL | re.MULTILINE
        ):
            if "torchrun_shell(" in m.group(2):
                found[m.group(1)] = "torchrun"
            for res in ("torchrun", "mpi"):
                if f"{{resources.{res}}}" in m.group(2):
                    found[m.group(1)] = res
    found.pop("serve", None)  # not in rule all
    return found


def test_every_job_is_a_slurm_job_and_multi_process_ones_span_nodes(cluster, slurm_run):
    wd, log = slurm_run
    jobs = slurm_jobs(log)
    local = set(re.findall(r"^localrule (\w+):", log, re.MULTILINE))
    allowed = {"all", "resolve_config"}  # workflow/rules/config.smk: localrules (a file writer)
    assert local <= allowed, f"jobs that ran outside SLURM: {local - allowed}"
    multi = _multi_process_rules()
    assert {"train", "evaluate", "inference"} <= set(multi)
    for rule, launcher in multi.items():
        mine = [j for j in jobs if j["rule"] == rule]
        assert mine, f"{rule} was not submitted to SLURM"
        for job in mine:
            f = job_fields(cluster, job["slurm_id"])
            assert f["JobState"] == "COMPLETED" and f["NumNodes"] == "2", (rule, f)
            if launcher == "torchrun":  # the launcher's srun line, in the rule's own log
                text = (wd / job["log"]).read_text()
                assert "distlm-launch: srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in text, rule


def _tensors(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_same_results_as_the_local_profile(slurm_run, workflow_run):
    wd, _ = slurm_run
    local, remote = workflow_run / "results", wd / "results"
    # data and base model: same config sections, byte-identical weights
    assert (
        json.loads((local / "model/base/distlm.json").read_text())["model_sha256"]
        == json.loads((remote / "model/base/distlm.json").read_text())["model_sha256"]
    )
    # broadcast: 3 ranks both ways (one node / spread 2 + 1 over two), every bucket verified
    ba, bb = (read_document(r / "broadcast/report.json", BroadcastReport) for r in (local, remote))
    assert ba.world_size == bb.world_size and bb.stats.all_verified and ba.stats.all_verified
    assert ba.model_sha256 == bb.model_sha256
    # training: world size 2 both ways (2 ranks on one node / 1 rank on each of 2 nodes). Losses
    # agree to float32 rounding (measured: bit-equal at most steps, <1e-7 relative at the others),
    # the weights after AdamW to ~1e-6 absolute.
    a, b = (_tensors(r / "train/final/model.safetensors") for r in (local, remote))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, f"trained weights differ by up to {worst}"
    rows = [list(csv.DictReader((r / "train/metrics.csv").open())) for r in (local, remote)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]]
    for ra, rb in zip(*rows):
        assert abs(float(ra["loss"]) - float(rb["loss"])) <= 1e-6 * abs(float(ra["loss"])), (ra, rb)
    for name in ("base", "trained"):
        ea, eb = (json.loads((r / f"eval/{name}.json").read_text()) for r in (local, remote))
        assert ea["world_size"] == eb["world_size"] == 2
        for split in ea["splits"]:
            pa, pb = ea["splits"][split]["perplexity"], eb["splits"][split]["perplexity"]
            assert abs(pa - pb) <= 1e-6 * pa, (name, split, pa, pb)
    ga, gb = ((r / "inference/generations.jsonl").read_text().splitlines() for r in (local, remote))
    assert [json.loads(x)["text"] for x in ga] == [json.loads(x)["text"] for x in gb]
    assert (remote / "report/summary.html").exists()


def test_forcerun_resubmits_only_the_stage_and_its_dependents(cluster, profile, slurm_run):
    wd, _ = slurm_run
    env = cluster.env_changes()
    configs = (TINY, SLURM_CONFIG)
    planned = run_snakemake(
        wd, "--forcerun", "inference", "--dry-run", configfiles=configs, profile=profile, env=env
    ).stdout
    planned_rules = set(re.findall(r"^rule (\w+):", planned, re.MULTILINE)) - {"all"}
    assert planned_rules == {"inference", "report"}, planned_rules
    before = {
        p: p.stat().st_mtime_ns
        for p in (wd / "results").rglob("*")
        if p.is_file()
        and not p.is_relative_to(wd / "results/inference")
        and not p.is_relative_to(wd / "results/report")
        and "benchmarks" not in p.parts
    }
    proc = run_snakemake(
        wd, "--forcerun", "inference", configfiles=configs, profile=profile, env=env
    )
    subs = submissions(proc.stdout + proc.stderr)
    assert set(subs) == planned_rules and all(len(v) == 1 for v in subs.values()), subs
    changed = [str(p) for p, t in before.items() if p.stat().st_mtime_ns != t]
    assert not changed, f"upstream outputs rewritten: {changed}"


def test_a_failing_job_is_reported_with_its_slurm_log(cluster, profile, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(HARNESS / "failing" / "Snakefile"),
        "--directory",
        str(tmp_path),
        "--profile",
        str(profile),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=cluster.env(), check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    jobs = {j["rule"]: j for j in slurm_jobs(out)}
    assert set(jobs) == {"fail"}, out[-3000:]
    slurm_log = jobs["fail"]["slurm_log"]
    assert Path(slurm_log).exists() and slurm_log in out.split("Error in rule fail", 1)[1]
    # show-failed-logs prints the rule's log: the failing rank and its host are named
    assert "distlm-check: rank 1 on node2 fails" in out, out[-3000:]
    f = job_fields(cluster, jobs["fail"]["slurm_id"])
    assert f["JobState"] == "FAILED", f


def test_a_sweeps_training_runs_are_in_the_queue_together(cluster, profile, tmp_path):
    """Two learning rates of a sweep train in two stage folders (own checkpoints, own lease), so
    their jobs are independent: SLURM runs both at once (docs/sweeps.md)."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("sweep:\n  grid:\n    train.lr: [0.003, 0.001]\n")
    wd = tmp_path / "wd"
    proc = run_snakemake(
        wd,
        "--until",
        "train",
        configfiles=(TINY, SLURM_CONFIG, sweep),
        profile=profile,
        env=cluster.env_changes(),
    )
    subs = submissions(proc.stdout + proc.stderr)
    assert len(subs["train"]) == 2, subs
    spans = []
    for job_id in subs["train"]:
        f = job_fields(cluster, job_id)
        assert f["JobState"] == "COMPLETED", f
        spans.append((f["StartTime"], f["EndTime"]))  # ISO 8601: they sort as strings
    (start_a, end_a), (start_b, end_b) = spans
    assert max(start_a, start_b) < min(end_a, end_b), (
        f"the trainings ran one after the other: {spans}"
    )
    leases = list((wd / "results/variants").glob("*/train/checkpoints"))
    assert len(leases) == 2, leases
