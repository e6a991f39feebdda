"""Readers for every metrics file the stages write, into pandas tables.

`collect` looks for each file at its place under `results/` (LAYOUT); an absent one (a stage that
was not run, profiling off) is recorded in `Inputs.missing` with the reason, and the report shows
a "not collected" note for it. A file that is present but malformed raises ReportError naming the
file and the field or column at fault.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pandas as pd

from distlm import DistlmError
from distlm.broadcast.documents import BroadcastReport
from distlm.core.documents import D, DocumentError, read_document
from distlm.dag.stages import BENCHMARKS, REPORT_READS, RESULTS, job_output
from distlm.data.documents import read_stats as read_data_stats
from distlm.evaluate.documents import EvalReport
from distlm.inference.documents import InferenceSweep, InferenceTiming
from distlm.train.documents import ProfileSummary

# Where each stage leaves its metrics, relative to the results folder (distlm.dag.stages.REPORT_READS).
LAYOUT = {
    **{key: job_output(job, out)[len(RESULTS) + 1 :] for key, (job, out) in REPORT_READS.items()},
    "benchmarks": BENCHMARKS[len(RESULTS) + 1 :],
}


class ReportError(DistlmError):
    """A metrics file exists but cannot be read; the message names the file."""


@dataclass
class Inputs:
    """Everything the report draws, as pandas tables; `missing` explains each absent input."""

    results: Path
    stats: dict | None = None
    splits: pd.DataFrame | None = None
    broadcast: dict | None = None
    receivers: pd.DataFrame | None = None
    metrics: pd.DataFrame | None = None
    val: pd.DataFrame | None = None
    profile: pd.DataFrame | None = None
    evals: pd.DataFrame | None = None
    timing: InferenceTiming | None = None  # the last run of the timing file
    inference: pd.DataFrame | None = None
    prompts: pd.DataFrame | None = None
    stages: pd.DataFrame | None = None
    generations: pd.DataFrame | None = None
    benchmarks: pd.DataFrame | None = None
    missing: dict[str, str] = field(default_factory=dict)
    layout: dict[str, str] = field(default_factory=lambda: dict(LAYOUT))  # one sweep run's own

    def path(self, key: str) -> Path:
        return self.results / self.layout[key]


# ----------------------------------------------------------------------------- helpers


def _numeric(col: Any) -> pd.Series:
    """A column (`df[name]`, which pandas types as Series | DataFrame) as numbers, NaN where a cell
    is not one (pandas' overloads say it may be a scalar; for a Series it is a Series)."""
    return cast(pd.Series, pd.to_numeric(col, errors="coerce"))


def _fail(path: Path, what: str, problem: str) -> ReportError:
    return ReportError(f"{path}: malformed {what}: {problem}")


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, what, f"not valid JSON ({e})") from None


def _csv(path: Path, what: str, *, sep: str = ",", required: tuple[str, ...] = ()) -> pd.DataFrame:
    try:
        df = pd.read_csv(path, sep=sep)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise _fail(path, what, f"cannot parse ({str(e).strip()})") from None
    absent = [c for c in required if c not in df.columns]
    if absent:
        raise _fail(
            path, what, f"missing column(s) {', '.join(absent)} (columns: {', '.join(df.columns)})"
        )
    for c in required:
        num = _numeric(df[c])
        bad = (num.isna() & df[c].notna()).to_numpy()
        if bad.any():
            row = int(bad.argmax())
            raise _fail(
                path, what, f"column {c!r} row {row + 1}: {df[c].iloc[row]!r} is not a number"
            )
        df[c] = num
    return df


def _number(obj: dict, key: str, path: Path, what: str, where: str = "") -> float:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, what, f"field {where}{key}: expected a number, got {v!r}")
    return float(v)


def _exp(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


# ----------------------------------------------------------------------------- readers


def _document(path: Path, cls: type[D], *, untagged: bool = False) -> D:
    try:
        return read_document(path, cls, untagged=untagged)
    except DocumentError as e:
        raise ReportError(str(e)) from None


def read_stats(path: Path) -> tuple[dict, pd.DataFrame]:
    """Dataset stats (DataStats, version 1 or 2) -> (header facts, one row per split, then one
    per shard: what its job made, in how long, at how many tokens a second)."""
    try:
        stats = read_data_stats(path)
    except DocumentError as e:
        raise ReportError(str(e)) from None
    rows = [
        {"part": name, **s.model_dump(exclude={"tokens_sha256"})}
        for name, s in stats.splits.items()
    ]
    rows += [
        {
            "part": f"shard {sh.id}",
            "origin": sh.where,
            "documents": sum(sh.documents.values()),
            "tokens": sum(sh.tokens.values()),
            "text_mb": round(sh.text_bytes / 1e6, 2),
            "seconds": sh.seconds,
            "tokens_per_s": sh.tokens_per_s,
            "peak_rss_mb": sh.peak_rss_mb,
        }
        for sh in stats.shards
    ]
    facts = {k: getattr(stats, k) for k in ("source", "tokenizer", "vocab_size", "block_size")}
    if stats.shards:
        facts["shards"] = len(stats.shards)
    return facts, pd.DataFrame(rows)


def read_benchmarks(folder: Path, exclude: AbstractSet[str] = frozenset()) -> pd.DataFrame | None:
    """Snakemake `benchmark:` TSVs -> one row per rule: wall seconds, peak RSS (MB), CPU seconds."""
    return read_benchmark_files(p for p in folder.glob("*.tsv") if p.stem not in exclude)


def read_benchmark_files(files) -> pd.DataFrame | None:
    """`read_benchmarks` of the given TSVs (a sweep run's jobs lie in several folders)."""
    # In the order the jobs finished (a benchmark is written when its job ends).
    files = sorted(files, key=lambda p: (p.stat().st_mtime, p.name))
    if not files:
        return None
    rows = []
    for p in files:
        df = _csv(p, "Snakemake benchmark", sep="\t", required=("s",))
        if df.empty:
            raise _fail(p, "Snakemake benchmark", "no measurement row")
        row = {"rule": p.stem, "runs": len(df), "wall_s": df["s"].mean()}
        for col, out in (
            ("max_rss", "max_rss_mb"),
            ("cpu_time", "cpu_s"),
            ("mean_load", "mean_load"),
        ):
            row[out] = _numeric(df[col]).mean() if col in df else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def read_metrics(path: Path) -> pd.DataFrame:
    """Training metrics CSV: one row per logged step; `ppl` from its perplexity (or exp(loss))."""
    df = _csv(path, "training metrics", required=("step", "loss"))
    if df.empty:
        raise _fail(path, "training metrics", "no rows")
    if "perplexity" in df:
        df["ppl"] = pd.to_numeric(df["perplexity"], errors="coerce")
    else:
        df["ppl"] = df["loss"].map(_exp)
    return df.sort_values("step").reset_index(drop=True)


def read_val(path: Path) -> pd.DataFrame:
    """Validation CSV written during training: step, validation loss (and perplexity, tokens)."""
    df = _csv(path, "validation metrics", required=("step", "val_loss"))
    if "val_perplexity" in df:
        df["val_ppl"] = pd.to_numeric(df["val_perplexity"], errors="coerce")
    else:
        df["val_ppl"] = df["val_loss"].map(_exp)
    return df.sort_values("step").reset_index(drop=True)


def read_profile(folder: Path) -> tuple[pd.DataFrame | None, str]:
    """The profiler's top operators of every rank (`top-ops-rank<r>.json`, data files: tables,
    like metrics.csv), long format.

    Returns (table, note): table None with the reason in `note` when no window was captured
    (`profile.json`, a ProfileSummary document, says whether profiling was on and why nothing was
    captured).
    """
    summary = folder / "profile.json"
    # untagged: the profile.json of a release before the tag reads unchanged
    info = _document(summary, ProfileSummary, untagged=True) if summary.is_file() else None
    if info is not None and not info.enabled:
        return None, f"profiling is off: train.profile.enabled is false ({summary})"
    files = sorted(folder.glob("top-ops-rank*.json"), key=lambda p: p.name)
    if not files:
        why = (
            info.reason if info is not None else None
        ) or "the profiler wrote no top-ops-rank<r>.json"
        return None, f"no profiler window was captured: {why}"
    rows = []
    for path in files:
        what = "profiler table"
        rep = _json(path, what)
        ops = rep.get("ops") if isinstance(rep, dict) else None
        if not isinstance(ops, list):
            raise _fail(path, what, "field ops: expected a list of operators")
        key = rep.get("sort_by", "self_cpu_us")
        for i, op in enumerate(ops):
            if not isinstance(op, dict) or "name" not in op:
                raise _fail(path, what, f"ops[{i}]: expected an object with a name")
            rows.append(
                {
                    "rank": int(rep.get("rank", path.stem.rsplit("rank", 1)[-1])),
                    "operator": str(op["name"]),
                    "calls": int(_number(op, "calls", path, what, f"ops[{i}].")),
                    "self_ms": _number(op, key, path, what, f"ops[{i}].") / 1000.0,
                    "total_ms": _number(
                        op,
                        key.replace("self_", "").replace("_us", "_total_us"),
                        path,
                        what,
                        f"ops[{i}].",
                    )
                    / 1000.0,
                    "self_pct": op.get("self_pct"),
                }
            )
    df = pd.DataFrame(rows)
    df.attrs["sort_by"] = "self device time" if "device" in key else "self CPU time"
    df.attrs["window"] = info.window.model_dump() if info is not None else rep.get("window")
    return df, ""


def read_eval(path: Path, model: str) -> pd.DataFrame:
    """Evaluation report (EvalReport) -> one row per split: loss, perplexity, tokens scored."""
    ev = _document(path, EvalReport)
    return pd.DataFrame(
        [
            {
                "model": model,
                "split": split,
                "loss": r.mean_loss,
                "perplexity": r.perplexity,
                "tokens_scored": r.tokens_scored,
                "tokens_per_s": r.tokens_per_s,
            }
            for split, r in ev.splits.items()
        ]
    )


_BROADCAST_FACTS = (
    "transport",
    "backend",
    "device",
    "bytes",
    "tensors",
    "buckets",
    "bucket_bytes",
    "chunk_bytes",
    "seconds",
    "gbps",
    "all_verified",
)


def read_broadcast(path: Path) -> tuple[dict, pd.DataFrame]:
    """Broadcast report (BroadcastReport) -> (run facts, one row per receiver with seconds and
    GB/s); the sender's overall GB/s (its clock stopped when the last receiver reported) is kept
    per row as `all_gbps`. A report with no receiver (one rank: distlm.broadcast's
    `load_to_device`) has one row, the sender's own move to its device, under its transport
    (`host-to-cuda`)."""
    rep = _document(path, BroadcastReport)
    s = rep.stats
    measured = s.receivers or [s]  # no receiver: what the sender measured alone
    rows = [
        {
            "transport": s.transport,
            "receiver": r.rank,
            "bytes": s.bytes,
            "seconds": r.seconds,
            "gbps": math.nan if r.gbps is None else r.gbps,  # None: no measurable time
            "verified": r.verified,
            "checksum_seconds": r.checksum_seconds,
            "unpack_seconds": r.unpack_seconds,
            "all_gbps": s.gbps,
        }
        for r in measured
    ]
    facts = {
        **{k: getattr(s, k) for k in _BROADCAST_FACTS if hasattr(s, k)},
        "world_size": rep.world_size,
        "model": rep.model,
    }
    return facts, pd.DataFrame(rows)


def read_timing(
    path: Path,
) -> tuple[InferenceTiming, pd.DataFrame, pd.DataFrame | None, pd.DataFrame | None]:
    """Inference timing (InferenceTiming) -> (the last run, one row per run (stages, prompts in
    flight), per-prompt timing of the last run, per-stage time split of the last run).

    A file holds one run, or a sweep (InferenceSweep) over stage counts and lanes. A file without
    a format tag (written before the types had one) is read as the one or the other by its
    fields: {"runs": [...]} is a sweep."""
    what = "inference timing"
    t = _json(path, what)
    sweep = isinstance(t, dict) and (
        t.get("format") == InferenceSweep.tag() or ("format" not in t and "runs" in t)
    )
    runs = (
        _document(path, InferenceSweep, untagged=True).runs
        if sweep
        else [_document(path, InferenceTiming, untagged=True)]
    )
    if not runs:
        raise _fail(path, what, "field runs: no run")
    rows = [
        {
            "stages": r.stages,
            "lanes": r.lanes,
            "prompts": r.prompts,
            "tokens": r.tokens,
            "wall_s": r.wall_s,
            "tokens_per_s": math.nan if r.tokens_per_s is None else r.tokens_per_s,
            "ttft_mean_s": r.ttft_s.mean,
            "ttft_max_s": r.ttft_s.max,
        }
        for r in runs
    ]
    last = runs[-1]
    prompts = pd.DataFrame(last.per_prompt) if last.per_prompt else None
    if prompts is not None:
        absent = [c for c in ("index", "ttft_s") if c not in prompts]
        if absent:
            raise _fail(path, what, f"per_prompt: missing field(s) {', '.join(absent)}")
    stages = pd.DataFrame(last.per_stage) if last.per_stage else None
    if stages is not None:
        absent = [c for c in ("stage", "compute_s") if c not in stages]
        if absent:
            raise _fail(path, what, f"per_stage: missing field(s) {', '.join(absent)}")
        stages = stages.sort_values("stage").reset_index(drop=True)
    return last, pd.DataFrame(rows), prompts, stages


def read_generations(path: Path, limit: int = 20) -> pd.DataFrame:
    """Generations JSON lines -> prompt and generated text of the first `limit` records."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(path, "generations", f"line {n} is not valid JSON ({e})") from None
            if not isinstance(rec, dict) or "prompt" not in rec:
                raise _fail(path, "generations", f"line {n}: expected an object with a prompt")
            row = {"prompt": rec["prompt"], "generated": rec.get("text", "")}
            row.update({k: rec[k] for k in ("tokens", "finish_reason", "ttft_s") if k in rec})
            rows.append(row)
            if len(rows) >= limit:
                break
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- collect


def collect(
    results: str | os.PathLike,
    *,
    exclude_rules=("report",),
    layout: dict[str, str] | None = None,
    benchmark_files: list[Path] | None = None,
) -> Inputs:
    """Read every metrics file under `results`; absent ones get a reason in `Inputs.missing`.
    `layout` (LAYOUT's keys) and `benchmark_files` place one run of a sweep
    (distlm.report.compare)."""
    inp = Inputs(results=Path(results), layout={**LAYOUT, **(layout or {})})

    def absent(key: str, why: str) -> None:
        p = inp.path(key)
        inp.missing[key] = (
            f"not collected: {p}{'/' if key in ('profile', 'benchmarks') else ''} is absent ({why})"
        )

    if inp.path("stats").is_file():
        inp.stats, inp.splits = read_stats(inp.path("stats"))
    else:
        absent("stats", "the dataset stage has not run")
    if inp.path("broadcast").is_file():
        inp.broadcast, inp.receivers = read_broadcast(inp.path("broadcast"))
    else:
        absent("broadcast", "the broadcast stage has not run")
    if inp.path("metrics").is_file():
        inp.metrics = read_metrics(inp.path("metrics"))
    else:
        absent("metrics", "the train stage has not run")
    if inp.path("val").is_file():
        inp.val = read_val(inp.path("val"))
    else:
        absent("val", "the train stage has not run or ran no validation")
    if inp.path("profile").is_dir():
        inp.profile, why = read_profile(inp.path("profile"))
        if inp.profile is None:
            inp.missing["profile"] = f"not collected: {why}"
    else:
        absent("profile", "the train stage has not run")
    evals = []
    for model in ("base", "trained"):
        key = f"eval_{model}"
        if inp.path(key).is_file():
            evals.append(read_eval(inp.path(key), model))
        else:
            absent(key, "the eval stage has not run")
    inp.evals = pd.concat(evals, ignore_index=True) if evals else None
    if inp.path("timing").is_file():
        inp.timing, inp.inference, inp.prompts, inp.stages = read_timing(inp.path("timing"))
    else:
        absent("timing", "the inference stage has not run")
    if inp.path("generations").is_file():
        inp.generations = read_generations(inp.path("generations"))
    else:
        absent("generations", "the inference stage has not run")
    bench = inp.path("benchmarks")
    if benchmark_files is not None:
        inp.benchmarks = read_benchmark_files(benchmark_files)
    else:
        inp.benchmarks = read_benchmarks(bench, set(exclude_rules)) if bench.is_dir() else None
    if inp.benchmarks is None:
        absent("benchmarks", "no rule with a benchmark has run")
    return inp
