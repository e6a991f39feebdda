"""Sweeps (distlm.dag.sweep, workflow/rules/sweep.smk): runs from names and a grid, validated before
any job starts; each job once per distinct setting, derived from the stage declarations; the
caching cases as dry runs on one finished tiny 2 x 2 sweep; the comparison report."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, SINGLE, TINY, run_snakemake, snakemake_cmd
from test_reruns import MATRIX

from distlm.core.documents import read_document
from distlm.dag.config import ConfigError, deep_merge, load_config
from distlm.dag.stages import reruns
from distlm.dag.sweep import SweepError, SweepRun, grid_name, job_counts, plan_sweep

TINY_SWEEP = ROOT / "tests" / "configs" / "tiny-sweep.yaml"
# the sweep's run (sweep_run): one rank a stage, as the sharing does not depend on the ranks; the
# grid's inference.stages overrides tiny-single.yaml's
SWEPT = (TINY, SINGLE, TINY_SWEEP)
LRS, STAGES_ = (0.003, 0.001), (1, 3)
RUNS = [f"lr-{lr}_stages-{s}" for lr in LRS for s in STAGES_]


def plan(sweep: dict):
    """The plan of `sweep` over what the workflow reads: config/config.yaml, then tiny.yaml."""
    tiny = yaml.safe_load(TINY.read_text())
    return plan_sweep(load_config(ROOT / "config/config.yaml", deep_merge(tiny, {"sweep": sweep})))


# ----------------------------------------------------------------------------- the plan


def test_no_sweep_is_no_plan():
    assert plan_sweep(load_config(TINY)) is None


def test_grid_runs_are_named_from_their_values():
    p = plan({"grid": {"train.lr": list(LRS), "inference.stages": list(STAGES_)}})
    assert list(p.runs) == RUNS
    assert p.varied() == ["train.lr", "inference.stages"]
    # keys that end alike are told apart by more of their dotted path
    assert grid_name(["train.seed", "inference.seed"], (1, 2)) == "train.seed-1_inference.seed-2"
    assert grid_name(["eval.splits"], (["validation", "test"],)) == "splits-validation+test"


def test_named_runs_take_nested_sections_or_dotted_keys():
    p = plan({"runs": {"a": {"train": {"lr": 0.001}}, "b": {"train.lr": 0.001}}})
    assert p.runs["a"].config == p.runs["b"].config
    assert p.runs["a"].variants == p.runs["b"].variants  # the name is no part of a variant


@pytest.mark.parametrize("name", ["x/y", "..", "-lead", ".hidden", "a b", "é", "a" * 81])
def test_unsafe_run_names_are_refused_naming_the_run(name):
    with pytest.raises(ConfigError) as e:
        plan({"runs": {name: {"train.lr": 0.001}}})
    assert repr(name)[1:-1][:40] in str(e.value), str(e.value)


def test_unknown_key_and_bad_value_name_the_run_and_the_key():
    with pytest.raises(ConfigError, match=r"sweep run 'fast'.*\n.*train\.lrr: unknown key"):
        plan({"runs": {"fast": {"train.lrr": 0.1}}})
    with pytest.raises(ConfigError, match=r"sweep run 'neg'.*\n.*train\.lr"):
        plan({"runs": {"neg": {"train": {"lr": -1}}}})
    with pytest.raises(ConfigError, match=r"sweep run 'stages-9'.*\n.*inference\.stages: 9"):
        plan({"grid": {"inference.stages": [9]}})  # more stages than tiny.yaml's 3 layers


def test_whole_sweep_sections_and_empty_sweeps_are_refused():
    with pytest.raises(SweepError, match=r"sweep run 'a': report: not a per-run setting"):
        plan({"runs": {"a": {"report": {"formats": ["svg"]}}}})
    with pytest.raises(ConfigError, match="sweep"):
        plan({"runs": {}})
    with pytest.raises(SweepError, match="run name 'lr-0.001' is taken"):
        plan({"runs": {"lr-0.001": {}}, "grid": {"train.lr": [0.001]}})


def test_a_train_sweep_shares_data_model_broadcast_and_the_base_eval():
    p = plan({"grid": {"train.lr": list(LRS), "inference.stages": list(STAGES_)}})
    counts = {job: ran for job, (ran, separate) in job_counts(p).items()}
    assert {separate for ran, separate in job_counts(p).values()} == {4}
    assert counts == {
        "prepare_data": 1,
        "serialize_model": 1,
        "broadcast": 1,
        "train": 2,
        "evaluate[base]": 1,
        "evaluate[trained]": 2,
        "shard[trained]": 4,
        "inference": 4,
        "report": 1,
    }
    inf = plan({"grid": {"inference.temperature": [0.5, 1.0]}})
    assert len(inf.shared["train"]) == 1 and len(inf.shared["inference"]) == 2


# Per-run keys of the rerun matrix: a two-run sweep over one key's edit runs two variants of
# exactly the jobs that the declarations say an edit of the key reruns (report aside).
_PER_RUN = [k for k in MATRIX if k.split(".")[0] not in ("serve", "report")]


@pytest.mark.parametrize("key", _PER_RUN)
def test_sharing_follows_the_stage_declarations(key):
    # Every row's edit is valid on its own (test_reruns dry-runs each), so a plan that refuses
    # one is a failure, never a skipped row.
    p = plan({"runs": {"base": {}, "edit": MATRIX[key][0]}})
    assert p.runs["base"].config != p.runs["edit"].config, key  # test_reruns checks every row
    split = {job for job, vs in p.shared.items() if len(vs) > 1}
    assert split == set(reruns(key)) - {"report"}, key


def test_variants_depend_on_the_run_alone():
    """Adding or removing a run leaves every other run's variants; editing one run's override
    changes only that run's variants of the jobs that read the key and their consumers."""
    three = plan({"runs": {"a": {"train.lr": 0.003}, "b": {"train.lr": 0.001}, "c": {}}})
    two = plan({"runs": {"a": {"train.lr": 0.003}, "b": {"train.lr": 0.001}}})
    assert {n: r.variants for n, r in two.runs.items()} == {
        n: three.runs[n].variants for n in two.runs
    }
    edited = plan({"runs": {"a": {"train.lr": 0.003}, "b": {"train.lr": 0.001, "eval.stride": 16}}})
    assert edited.runs["a"].variants == two.runs["a"].variants
    moved = {j for j, v in edited.runs["b"].variants.items() if v != two.runs["b"].variants[j]}
    assert moved == {"evaluate[base]", "evaluate[trained]"}


def test_the_report_says_what_is_missing_and_drops_runs_that_left(tmp_path):
    from distlm.dag.sweep import describe
    from distlm.report.compare import build_sweep_report

    results = tmp_path / "results"
    stale = results / "runs" / "gone"
    stale.mkdir(parents=True)
    (stale / "run.json").write_text("{}")
    p = plan({"runs": {"a": {"train.lr": 0.003}}})
    written = build_sweep_report(results, results / "report", runs=describe(p))
    assert not stale.exists()
    run = read_document(results / "runs/a/run.json", SweepRun)
    assert run.override == {"train": {"lr": 0.003}} and run.varied == {}
    assert run.jobs["train"] == f"results/variants/{p.runs['a'].variants['train']}"
    summary = (results / "report/summary.html").read_text()
    assert "a</a>" in summary and written[0] == results / "report/summary.html"
    assert (results / "report/figures/sweep_loss.png").stat().st_size > 0  # says not collected


# ----------------------------------------------------------------------------- the workflow


def _job_stats(out: str) -> dict[str, int]:
    """Snakemake's "Job stats" table -> rule -> count (rule all and resolve_config left out)."""
    table = out.split("Job stats:", 1)[1] if "Job stats:" in out else ""
    counts = {}
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    for k in ("all", "resolve_config", "total"):
        counts.pop(k, None)
    return counts


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    wd = tmp_path_factory.mktemp("sweep")
    proc = run_snakemake(wd, configfiles=tuple(SWEPT))
    return wd, _job_stats(proc.stdout + proc.stderr)


def _dry(forks, wd: Path, tmp: Path, sweep: dict, name: str) -> dict[str, int]:
    edit = tmp / f"{name}.yaml"
    edit.write_text(yaml.safe_dump({"sweep": sweep}, sort_keys=False))  # grid order names runs
    proc = forks.run(snakemake_cmd(wd, "-n", "--nolock", configfiles=(TINY, SINGLE, edit)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return _job_stats(out)


@pytest.mark.slow
def test_tiny_sweep_runs_shared_stages_once(sweep_run):
    _, counts = sweep_run
    assert counts == {
        "data_tokenizer": 1,
        "tokenize_shard": 1,
        "prepare_data": 1,
        "serialize_model": 1,
        "broadcast": 1,
        "train": 2,
        "evaluate": 3,  # the base model once, each trained model once
        "shard": 4,
        "inference": 4,
        "report": 1,
    }, counts


@pytest.mark.slow
def test_tiny_sweep_writes_per_run_outputs_and_the_comparison(sweep_run):
    wd, _ = sweep_run
    runs = {n: read_document(wd / f"results/runs/{n}/run.json", SweepRun) for n in RUNS}
    for name, run in runs.items():
        assert run.varied == {"train.lr": float(name[3:8]), "inference.stages": int(name[-1])}
        for job, folder in run.jobs.items():
            assert (wd / folder).is_dir(), (name, job, folder)
        assert (wd / run.jobs["train"] / "train/final/model.safetensors").is_file()
        assert (wd / run.jobs["train"] / "train/checkpoints").is_dir()  # its own checkpoints
        page = (wd / f"results/runs/{name}/report/summary.html").read_text()
        assert "Validation loss" in page and 'class="not-collected"' not in page
    # runs with one learning rate share their training; every run has its own inference
    train = {n: r.jobs["train"] for n, r in runs.items()}
    assert train[RUNS[0]] == train[RUNS[1]] != train[RUNS[2]] == train[RUNS[3]]
    assert len({r.jobs["inference"] for r in runs.values()}) == 4
    assert len({r.jobs["prepare_data"] for r in runs.values()}) == 1
    summary = (wd / "results/report/summary.html").read_text()
    assert summary.count('<img alt="Validation loss of every run') == 1
    assert summary.count('<img alt="Inference tokens/s') == 1
    table = summary.split('id="sweep_runs"', 1)[1].split("</table>", 1)[0]
    body = table.split("<tbody>", 1)[1]
    assert all(n in body for n in RUNS) and body.count("\u2605") == 1
    assert table.count('class="best"') == 1
    for f in ("figures/sweep_loss.png", "tables/sweep_runs.html", "figures/sweep_inference.png"):
        assert (wd / "results/report" / f).stat().st_size > 0


@pytest.mark.slow
def test_snakemake_report_labels_each_runs_outputs_with_the_run(sweep_run, tmp_path):
    wd, _ = sweep_run
    out = tmp_path / "report.html"
    cmd = snakemake_cmd(wd, "--report", str(out), configfiles=SWEPT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    text = out.read_text()
    for run in RUNS:  # every per-run figure and table, and the run's page
        assert len(re.findall(rf'"run": "{re.escape(run)}"', text)) == 18, run
    assert '"0. Sweep"' in text or "0. Sweep" in text


@pytest.mark.slow
def test_sweep_edits_rerun_only_what_they_touch(sweep_run, snakemake_forks, tmp_path):
    wd, _ = sweep_run
    grid = {"train.lr": list(LRS), "inference.stages": list(STAGES_)}
    named = {
        f"r{i}": {"train.lr": lr, "inference.stages": s}
        for i, (lr, s) in enumerate((lr, s) for lr in LRS for s in STAGES_)
    }
    assert _dry(snakemake_forks, wd, tmp_path, {"grid": grid}, "same") == {}
    # the same runs under other names: the report only (it names them)
    assert _dry(snakemake_forks, wd, tmp_path, {"runs": named}, "renamed") == {"report": 1}
    # adding a run: its own jobs (a new lr: train and what follows) and the report
    added = _dry(
        snakemake_forks, wd, tmp_path, {"runs": {**named, "new": {"train.lr": 0.002}}}, "added"
    )
    assert added == {"train": 1, "evaluate": 1, "shard": 1, "inference": 1, "report": 1}
    # removing a run: the report only
    removed = {k: v for k, v in named.items() if k != "r3"}
    assert _dry(snakemake_forks, wd, tmp_path, {"runs": removed}, "removed") == {"report": 1}
    # editing one run's inference key: that run's inference only (and the report)
    edited = {**named, "r0": {**named["r0"], "inference.max_new_tokens": 4}}
    assert _dry(snakemake_forks, wd, tmp_path, {"runs": edited}, "edited") == {
        "inference": 1,
        "report": 1,
    }
    # editing one run's training key: that run's training and what consumes it
    edited = {**named, "r0": {**named["r0"], "train.lr": 0.0007}}
    assert _dry(snakemake_forks, wd, tmp_path, {"runs": edited}, "edited-train") == {
        "train": 1,
        "evaluate": 1,
        "shard": 1,
        "inference": 1,
        "report": 1,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sweep", "says"),
    [
        (
            {"runs": {"fast": {"train.lrr": 0.1}}},
            r"sweep run 'fast' is invalid:\s+train\.lrr: unknown key",
        ),
        ({"runs": {"../up": {}}}, r"sweep\.runs\.\.\./up: run name '\.\./up' is not allowed"),
        (
            {"grid": {"inference.stages": [1, 9]}},
            r"sweep run 'stages-9' is invalid:\s+inference\.stages",
        ),
    ],
)
def test_a_bad_sweep_is_refused_before_any_job_starts(tmp_path, sweep, says):
    wd = tmp_path / "wd"
    edit = tmp_path / "sweep.yaml"
    edit.write_text(yaml.safe_dump({"sweep": sweep}))
    proc = subprocess.run(
        snakemake_cmd(wd, configfiles=(TINY, edit)), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert re.search(says, proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    assert not (wd / "results").exists() and not (wd / "logs").exists()
