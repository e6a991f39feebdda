"""The workflow as a user runs it: the whole DAG, the cache, dry runs, lint and bad configs."""

import json
import subprocess
import sys
import time

import yaml
from conftest import ROOT, TINY, run_snakemake


def test_backbone_outputs(workflow_run):
    stats = json.loads((workflow_run / "results/data/stats.json").read_text())
    assert stats["splits"]["train"]["blocks"] > 0
    meta = json.loads((workflow_run / "results/model/base/distlm.json").read_text())
    assert meta["n_layer"] == 3 and meta["created_by"] == "model"
    man = json.loads((workflow_run / "results/pipeline/trained/shards/manifest.json").read_text())
    assert man["stages"] == 3
    for rule in ("prepare_data", "serialize_model"):
        assert (workflow_run / f"results/benchmarks/{rule}.tsv").is_file()
        assert (workflow_run / "logs").is_dir()
    assert "INFO distlm.data" in (workflow_run / "logs/data/prepare.log").read_text()


def test_second_run_does_nothing(workflow_run):
    t = time.perf_counter()
    proc = run_snakemake(workflow_run)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert time.perf_counter() - t < 60  # generous: a cached run must not redo any work


def test_forcerun_plans_only_that_stage_and_what_follows(workflow_run):
    proc = run_snakemake(workflow_run, "-n", "--forcerun", "serialize_model")
    out = proc.stdout + proc.stderr
    assert (
        "serialize_model" in out
        and "prepare_data " not in out.split("Job stats:")[1].split("Reasons")[0]
    )


def test_bad_config_fails_before_any_job(tmp_path):
    bad = yaml.safe_load(TINY.read_text())
    bad["inference"]["stages"] = 9
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    proc = run_snakemake(tmp_path, configfile=tmp_path / "bad.yaml", check=False)
    assert proc.returncode != 0
    assert "inference.stages: 9 pipeline stages but the model has only 3 layers" in proc.stderr
    assert not (tmp_path / "results").exists()
    proc = run_snakemake(tmp_path, "--config", 'train={"max_stepz": 1}', check=False)
    assert proc.returncode != 0 and "train.max_stepz: unknown key" in proc.stderr
    # a key of an earlier release says where it went
    proc = run_snakemake(tmp_path, "--config", 'broadcast={"transport": "torch"}', check=False)
    assert proc.returncode != 0
    assert "broadcast.transport: moved to transfer.transport" in proc.stderr
    # --config hands nested values over as strings: they become the numbers their keys ask for
    # (then Snakemake's validate checks the result against the generated schema)
    run_snakemake(
        tmp_path, "-n", "--config", 'train={"max_steps": "7"}', 'transfer={"bucket_mb": "0.5"}'
    )
    assert not (tmp_path / "results").exists()


def test_real_setup_plans(tmp_path):
    """The real setup's dry run, offline: its hub data set's listing (made once, while a DAG is
    built with the hub reachable) kept in results/data/hub/ as the listing of a local copy laid
    out like wikitext. Without it, the run stops before any job, naming data.hub, and the dry
    run plans the data stage's gather alone, with a warning naming data.hub."""
    from test_data import english, write_wikitext_copy
    from test_kill_workflow import job_counts

    from distlm.dag.config import load_settings
    from distlm.data.sharding import list_hub, listing_key

    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    config = ROOT / "config/gpt2-wikitext2.yaml"
    named = "data.hub 'wikitext' / 'wikitext-2-raw-v1': could not load"
    proc = run_snakemake(tmp_path / "w", configfile=config, check=False, env=offline)
    assert proc.returncode != 0 and named in proc.stdout + proc.stderr
    assert not (tmp_path / "w" / "results").exists()  # no job ran
    proc = run_snakemake(tmp_path / "w", "-n", configfile=config, env=offline)
    assert named in proc.stdout + proc.stderr and "This dry run plans" in proc.stdout + proc.stderr
    jobs = job_counts(proc)
    assert "tokenize_shard" not in jobs and "data_tokenizer" not in jobs
    assert jobs["prepare_data"] == 1 and jobs["train"] == 1
    copy = tmp_path / "wikitext"
    write_wikitext_copy(copy, english(12))
    hub = load_settings(config).data.hub
    listing = list_hub(hub.model_copy(update={"path": str(copy)}), "text")
    kept = tmp_path / "w" / "results/data/hub" / f"{listing_key(hub, 'text')}.json"
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps(listing))
    proc = run_snakemake(tmp_path / "w", "-n", configfile=config, env=offline)
    jobs = job_counts(proc)
    assert jobs["tokenize_shard"] == 3 and jobs["data_tokenizer"] == 1  # a data file a split
    assert jobs["prepare_data"] == 1 and jobs["serialize_model"] == 1


def test_lint_and_format_are_clean(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(ROOT / "Snakefile"),
            "--directory",
            str(tmp_path),
            "--lint",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Congratulations" in proc.stdout + proc.stderr, (
        proc.stdout + proc.stderr
    )
    files = [str(ROOT / "Snakefile"), *map(str, sorted((ROOT / "workflow/rules").glob("*.smk")))]
    fmt = subprocess.run(
        [sys.executable, "-m", "snakefmt", "--check", *files], capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stderr


def test_snakemake_serve_answers_on_its_own_shards_and_ctrl_c_ends_it(workflow_run, tmp_path):
    """The README's `snakemake --profile profiles/local serve`: it cuts serve.stages shards, serves
    a real client, and Ctrl-C (SIGINT to the foreground process group) leaves no process behind."""
    import os
    import signal
    import urllib.request

    from conftest import copy_workflow, snakemake_cmd
    from procs import alive

    from distlm.runtime.dist import free_port

    work = copy_workflow(workflow_run, tmp_path / "work")  # serve_shard writes into it
    port = free_port()
    over = tmp_path / "serve.yaml"
    over.write_text(yaml.safe_dump({"serve": {"port": port, "stages": 2}}))
    log = tmp_path / "snakemake.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            snakemake_cmd(work, "serve", configfiles=(TINY, over)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
    try:
        deadline = time.monotonic() + 240
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    health = json.loads(r.read())
                    break
            except OSError:
                time.sleep(1)
        assert health is not None and health["status"] == "ok", log.read_text()[-3000:]
        body = json.dumps({"model": health["model"], "prompt": "The", "max_tokens": 4}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
        manifest = json.loads((work / "results/serve/pipeline/shards/manifest.json").read_text())
        assert manifest["stages"] == 2
        group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == proc.pid]
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        time.sleep(1)
        left = [p for p in group if alive(p)]
        assert not left, f"still running after Ctrl-C: {left}\n{log.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except OSError:
        return None
