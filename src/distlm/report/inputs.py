"""Readers for every metrics file the stages write, into pandas tables.

Each reader takes the file's path and returns tables, or `None` when the file is absent (a stage
that was not run, profiling off): the report then shows a "not collected" note. A file that is
present but malformed raises ReportError naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from distlm import DistlmError

# Where each stage leaves its metrics, relative to the results folder (the data contracts).
LAYOUT = {
    "stats": "data/stats.json",
    "broadcast": "broadcast/report.json",
    "metrics": "train/metrics.csv",
    "val": "train/val.csv",
    "profile": "train/profile",
    "eval_base": "eval/base.json",
    "eval_trained": "eval/trained.json",
    "timing": "inference/timing.json",
    "generations": "inference/generations.jsonl",
    "benchmarks": "benchmarks",
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
    profile_file: Path | None = None
    evals: pd.DataFrame | None = None
    timing: dict | None = None
    inference: pd.DataFrame | None = None
    generations: pd.DataFrame | None = None
    benchmarks: pd.DataFrame | None = None
    missing: dict[str, str] = field(default_factory=dict)

    def path(self, key: str) -> Path:
        return self.results / LAYOUT[key]


# ----------------------------------------------------------------------------- helpers


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
        num = pd.to_numeric(df[c], errors="coerce")
        bad = num.isna() & df[c].notna()
        if bad.any():
            row = int(bad.idxmax())
            raise _fail(path, what, f"column {c!r} row {row + 1}: {df[c][row]!r} is not a number")
        df[c] = num
    return df


def _number(obj: dict, key: str, path: Path, what: str, where: str = "") -> float:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, what, f"field {where}{key}: expected a number, got {v!r}")
    return float(v)


def _first(columns, *names: str) -> str | None:
    return next((n for n in names if n in columns), None)


# ----------------------------------------------------------------------------- readers


def read_stats(path: Path) -> tuple[dict, pd.DataFrame]:
    """Dataset stats JSON -> (header facts, one row per split)."""
    what = "dataset stats"
    stats = _json(path, what)
    splits = stats.get("splits") if isinstance(stats, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise _fail(path, what, "field splits: expected a mapping of split -> counts")
    rows = []
    for name, s in splits.items():
        row = {"split": name}
        for k in ("documents", "tokens", "blocks", "tail_tokens_not_in_blocks"):
            row[k] = int(_number(s, k, path, what, f"splits.{name}."))
        rows.append(row)
    facts = {k: stats[k] for k in ("source", "tokenizer", "vocab_size", "block_size") if k in stats}
    return facts, pd.DataFrame(rows)


def read_benchmarks(folder: Path, exclude: set[str] = frozenset()) -> pd.DataFrame | None:
    """Snakemake `benchmark:` TSVs -> one row per rule: wall seconds, peak RSS (MB), CPU seconds."""
    files = sorted(p for p in folder.glob("*.tsv") if p.stem not in exclude)
    if not files:
        return None
    rows = []
    for p in files:
        df = _csv(p, "Snakemake benchmark", sep="\t", required=("s",))
        if df.empty:
            raise _fail(p, "Snakemake benchmark", "no measurement row")
        row = {"rule": p.stem, "runs": len(df), "wall_s": df["s"].mean()}
        for col, out in (("max_rss", "max_rss_mb"), ("cpu_time", "cpu_s"), ("mean_load", "mean_load")):
            row[out] = pd.to_numeric(df[col], errors="coerce").mean() if col in df else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def read_metrics(path: Path) -> pd.DataFrame:
    """Training metrics CSV: one row per logged step; adds `ppl` and `tokens` when derivable."""
    df = _csv(path, "training metrics", required=("step", "loss"))
    if df.empty:
        raise _fail(path, "training metrics", "no rows")
    if "ppl" not in df:
        ppl = _first(df.columns, "perplexity", "train_ppl")
        df["ppl"] = df[ppl] if ppl else df["loss"].clip(upper=50).map(math.exp)
    tok = _first(df.columns, "tokens", "tokens_seen", "tokens_total")
    if tok and tok != "tokens":
        df["tokens"] = df[tok]
    return df.sort_values("step").reset_index(drop=True)


def read_val(path: Path) -> pd.DataFrame:
    """Validation CSV written during training: step and validation loss."""
    df = pd.read_csv(path) if path.stat().st_size else pd.DataFrame()
    loss = _first(df.columns, "val_loss", "loss")
    if loss is None:
        raise _fail(path, "validation metrics", f"no val_loss/loss column (columns: {list(df.columns)})")
    df = _csv(path, "validation metrics", required=("step", loss))
    if loss != "val_loss":
        df["val_loss"] = df[loss]
    if "val_ppl" not in df:
        df["val_ppl"] = df["val_loss"].clip(upper=50).map(math.exp)
    return df.sort_values("step").reset_index(drop=True)


def read_profile(folder: Path) -> tuple[pd.DataFrame, Path] | None:
    """The profiler's top-operator table: operator name and self time per operator."""
    tables = sorted(folder.glob("*.csv"))
    if not tables:
        return None
    path = next((p for p in tables if "top" in p.stem or "op" in p.stem), tables[0])
    df = pd.read_csv(path) if path.stat().st_size else pd.DataFrame()
    name = _first(df.columns, "name", "op", "operator", "key")
    self_t = next((c for c in df.columns if "self" in c.lower() and ("time" in c.lower() or c.lower().endswith("_us") or c.lower().endswith("_ms"))), None)
    if name is None or self_t is None:
        raise _fail(
            path, "profiler table",
            f"expected an operator name column and a self-time column (columns: {list(df.columns)})",
        )
    df = _csv(path, "profiler table", required=(self_t,))
    df = df.rename(columns={name: "operator"})
    df["self_time"] = df[self_t]
    df.attrs["self_time_column"] = self_t
    return df.sort_values("self_time", ascending=False).reset_index(drop=True), path


def read_eval(path: Path, model: str) -> pd.DataFrame:
    """Evaluation JSON -> one row per split: loss, perplexity, tokens scored."""
    what = "evaluation results"
    ev = _json(path, what)
    splits = ev.get("splits") if isinstance(ev, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise _fail(path, what, "field splits: expected a mapping of split -> results")
    rows = []
    for split, r in splits.items():
        row = {"model": model, "split": split}
        row["loss"] = _number(r, _first(r, "loss", "nll", "mean_nll") or "loss", path, what, f"splits.{split}.")
        row["perplexity"] = _number(r, _first(r, "perplexity", "ppl") or "perplexity", path, what, f"splits.{split}.")
        tok = _first(r, "tokens", "scored_tokens", "n_tokens")
        row["tokens"] = int(_number(r, tok, path, what, f"splits.{split}.")) if tok else None
        rows.append(row)
    return pd.DataFrame(rows)


def read_broadcast(path: Path) -> tuple[dict, pd.DataFrame]:
    """Broadcast report JSON -> (run facts, one row per receiver with seconds and GB/s)."""
    what = "broadcast report"
    rep = _json(path, what)
    runs = rep.get("runs") if isinstance(rep, dict) and "runs" in rep else [rep]
    rows = []
    for i, run in enumerate(runs):
        recv = run.get("receivers") if isinstance(run, dict) else None
        if not isinstance(recv, list) or not recv:
            raise _fail(path, what, "field receivers: expected a non-empty list")
        transport = str(run.get("transport", "?"))
        for j, r in enumerate(recv):
            where = f"receivers[{j}]."
            gbps = _first(r, "gbps", "GBps", "gb_per_s")
            rows.append({
                "transport": transport,
                "receiver": r.get("rank", j + 1),
                "bytes": int(_number(r if "bytes" in r else run, "bytes", path, what, where)),
                "seconds": _number(r, "seconds", path, what, where),
                "gbps": _number(r, gbps or "gbps", path, what, where),
                "digest_ok": r.get("digest_ok", r.get("verified")),
            })
    facts = {k: v for k, v in (runs[0] if len(runs) == 1 else rep).items() if not isinstance(v, (list, dict))}
    return facts, pd.DataFrame(rows)


def read_timing(path: Path) -> tuple[dict, pd.DataFrame]:
    """Inference timing JSON -> (run facts, one row per (stages, prompts in flight) setting)."""
    what = "inference timing"
    t = _json(path, what)
    if not isinstance(t, dict):
        raise _fail(path, what, "expected a JSON object")
    runs = t.get("runs") if isinstance(t.get("runs"), list) else [t]
    rows = []
    for i, r in enumerate(runs):
        where = f"runs[{i}]." if "runs" in t else ""
        rows.append({
            "stages": int(_number(r, "stages", path, what, where)),
            "lanes": int(_number(r, _first(r, "lanes", "in_flight", "prompts_in_flight") or "lanes", path, what, where)),
            "tokens_per_s": _number(r, _first(r, "tokens_per_s", "tokens_per_second") or "tokens_per_s", path, what, where),
            "ttft_s": _number(r, _first(r, "ttft_s", "time_to_first_token_s") or "ttft_s", path, what, where),
        })
    facts = {k: v for k, v in t.items() if not isinstance(v, (list, dict))}
    return facts, pd.DataFrame(rows)


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
            text = _first(rec, "completion", "generation", "text", "output")
            rows.append({"prompt": rec["prompt"], "generated": rec.get(text, "") if text else ""})
            if len(rows) >= limit:
                break
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- collect


def collect(results: str | os.PathLike, *, cfg: dict | None = None, exclude_rules=("report",)) -> Inputs:
    """Read every metrics file under `results`; absent ones get a reason in `Inputs.missing`."""
    inp = Inputs(results=Path(results))
    cfg = cfg or {}

    def absent(key: str, why: str) -> None:
        p = inp.path(key)
        inp.missing[key] = f"not collected: {p}{'/' if key in ('profile', 'benchmarks') else ''} is absent ({why})"

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
    prof = read_profile(inp.path("profile")) if inp.path("profile").is_dir() else None
    if prof is not None:
        inp.profile, inp.profile_file = prof
    else:
        enabled = cfg.get("train", {}).get("profile", {}).get("enabled")
        absent("profile", "profiling is off: train.profile.enabled is false" if enabled is False
               else "the train stage has not run or profiling is off")
    evals = []
    for model in ("base", "trained"):
        key = f"eval_{model}"
        if inp.path(key).is_file():
            evals.append(read_eval(inp.path(key), model))
        else:
            absent(key, "the eval stage has not run")
    inp.evals = pd.concat(evals, ignore_index=True) if evals else None
    if inp.path("timing").is_file():
        inp.timing, inp.inference = read_timing(inp.path("timing"))
    else:
        absent("timing", "the inference stage has not run")
    if inp.path("generations").is_file():
        inp.generations = read_generations(inp.path("generations"))
    else:
        absent("generations", "the inference stage has not run")
    bench = inp.path("benchmarks")
    inp.benchmarks = read_benchmarks(bench, set(exclude_rules)) if bench.is_dir() else None
    if inp.benchmarks is None:
        absent("benchmarks", "no rule with a benchmark has run")
    return inp
