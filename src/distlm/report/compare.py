"""The report of a sweep: the runs side by side, and each run's own report.

    from distlm.report.compare import build_sweep_report
    from distlm.dag.sweep import describe
    build_sweep_report("results", "results/report", runs=describe(plan), formats=["png"])

writes results/report/summary.html (the comparison: validation loss of every run on one figure
with train loss as faint lines; a table of runs with the varied keys, final validation loss, test
perplexity, training tokens/s, wall time and peak memory, the best run marked; inference tokens/s
and time to first token against the varied inference key when one varies; which jobs the runs
share), its figures and tables under results/report/, and per run results/runs/<run>/run.json
(distlm.dag.sweep.SweepRun) and results/runs/<run>/report/ (distlm.report.build_report of that run's
job variants).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from distlm.core.documents import write_document
from distlm.core.io import write_text
from distlm.core.log import get_logger
from distlm.dag.stages import BENCHMARKS, REPORT_READS, RESULTS, STAGES
from distlm.dag.sweep import (
    RUNS,
    SweepDescription,
    SweepRun,
    output_path,
    run_dir,
    variant_folder,
    variant_path,
)
from distlm.report.build import _CSS, _png, _save, table_html
from distlm.report.figures import _figure, not_collected
from distlm.report.inputs import (
    read_benchmark_files,
    read_eval,
    read_metrics,
    read_timing,
    read_val,
)
from distlm.report.items import SWEEP_ITEMS

log = get_logger(__name__)

# ----------------------------------------------------------------------------- inputs


def run_layout(variants: dict[str, str]) -> dict[str, str]:
    """LAYOUT (paths relative to results/) of one run: each input (distlm.dag.stages.REPORT_READS)
    where its job's variant writes it."""
    return {
        key: output_path(job, out, variants[job])[len(RESULTS) + 1 :]
        for key, (job, out) in REPORT_READS.items()
    }


def run_benchmarks(results: Path, variants: dict[str, str]) -> list[Path]:
    """The Snakemake benchmark TSVs of a run's job variants."""
    return sorted(
        p
        for v in dict.fromkeys(variants.values())
        for p in (results / variant_path(BENCHMARKS, v)[len(RESULTS) + 1 :]).glob("*.tsv")
    )


@dataclass
class RunData:
    name: str
    varied: dict[str, Any]
    train: str  # its training variant: runs that share it share their curves
    metrics: pd.DataFrame | None
    val: pd.DataFrame | None
    evals: pd.DataFrame | None
    timing: pd.DataFrame | None
    bench: pd.DataFrame | None


def _read(path: Path, reader, *args):
    return reader(path, *args) if path.is_file() else None


def collect_runs(results: Path, desc: SweepDescription) -> list[RunData]:
    out = []
    for name, r in desc.runs.items():
        lay = {k: results / p for k, p in run_layout(r.variants).items()}
        timing = _read(lay["timing"], read_timing)
        files = run_benchmarks(results, r.variants)
        out.append(
            RunData(
                name=name,
                varied=r.varied,
                train=r.variants["train"],
                metrics=_read(lay["metrics"], read_metrics),
                val=_read(lay["val"], read_val),
                evals=_read(lay["eval_trained"], read_eval, "trained"),
                timing=timing[1] if timing else None,
                bench=read_benchmark_files(p for p in files if p.stem == "train"),
            )
        )
    return out


# ----------------------------------------------------------------------------- figures, tables


def _last(df: pd.DataFrame | None, col: str) -> float:
    return float(df[col].iloc[-1]) if df is not None and not df.empty else math.nan


def figure_loss(runs: list[RunData]) -> Figure | None:
    """One line per training variant: runs that share their training (they differ only in
    later stages) share a line, labelled with all their names."""
    if not any(r.val is not None or r.metrics is not None for r in runs):
        return None
    fig, (ax,) = _figure(1, 1, "Validation loss per run (train loss faint)")
    fig.set_size_inches(9.5, 5.2)
    trainings: dict[str, list[RunData]] = {}
    for r in runs:
        trainings.setdefault(r.train, []).append(r)
    for i, group in enumerate(trainings.values()):
        r, color = group[0], f"C{i % 10}"
        label = ", ".join(g.name for g in group)
        if r.metrics is not None:
            ax.plot(r.metrics["step"], r.metrics["loss"], color=color, alpha=0.3, lw=1)
        if r.val is not None:
            ax.plot(r.val["step"], r.val["val_loss"], "o-", color=color, lw=2, ms=4, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=9, title="validation loss of run(s)")
    return fig


def table_runs(runs: list[RunData], varied: list[str]) -> pd.DataFrame:
    rows = []
    for r in runs:
        ev = r.evals
        test = ev[ev["split"] == "test"] if ev is not None else None
        tps = r.metrics["tokens_per_s"] if r.metrics is not None else None
        b = r.bench
        rows.append(
            {
                "run": r.name,
                **{k: r.varied.get(k) for k in varied},
                "final val loss": _last(r.val, "val_loss"),
                "test perplexity": float(test["perplexity"].iloc[0])
                if test is not None and not test.empty
                else math.nan,
                # the median over logged steps: the first steps include warm-up
                "train tokens/s": float(tps.median()) if tps is not None else math.nan,
                "train wall s": _last(b, "wall_s"),
                "train peak MB": _last(b, "max_rss_mb"),
            }
        )
    df = pd.DataFrame(rows)
    best = df["final val loss"].idxmin() if df["final val loss"].notna().any() else None
    if best is not None:
        mark = df.index == best
        df.loc[mark, "run"] = "\u2605 " + df.loc[mark, "run"].astype(str)
    df.attrs["caption"] = (
        "\u2605 lowest final validation loss (runs that share their training share it too). train tokens/s: median over logged steps; wall s "
        "and peak MB: the train job's Snakemake benchmark (max RSS of the job's processes)."
    )
    df.attrs["best"] = best
    return df


def figure_inference(runs: list[RunData], varied: list[str]) -> Figure | None:
    """tokens/s and TTFT against the first varied inference key; one line per value of the
    other varied keys."""
    keys = [k for k in varied if k.startswith("inference.")]
    have = [(r, r.timing) for r in runs if r.timing is not None and not r.timing.empty]
    if not keys or not have:
        return None
    x, others = keys[0], [k for k in varied if k != keys[0]]
    rows = [
        {
            "x": r.varied[x],
            "series": ", ".join(f"{k.split('.')[-1]}={r.varied[k]}" for k in others) or r.name,
            "tokens_per_s": float(timing["tokens_per_s"].iloc[-1]),
            "ttft": float(timing["ttft_mean_s"].iloc[-1]),
        }
        for r, timing in have
        if timing is not None
    ]
    df = pd.DataFrame(rows)
    numeric = pd.api.types.is_numeric_dtype(df["x"])
    fig, axes = _figure(1, 2, f"Inference against {x}")
    for ax, col, label in (
        (axes[0], "tokens_per_s", "generated tokens/s"),
        (axes[1], "ttft", "time to first token (s), mean"),
    ):
        for series, d in df.groupby("series", sort=False):
            d = d.sort_values("x") if numeric else d
            ax.plot(d["x"].astype(float if numeric else str), d[col], "o-", label=series)
        ax.set_xlabel(x)
        if numeric:
            ax.set_xticks(sorted(df["x"].unique()))
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=9)
    return fig


def table_jobs(desc: SweepDescription) -> pd.DataFrame:
    n = len(desc.runs)
    rows = [
        {
            "job": job,
            "jobs run": len(vs),
            "as separate folders": n,
            "shared": "; ".join(
                f"{v}: {', '.join(names)}" for v, names in vs.items() if len(names) > 1
            ),
        }
        for job, vs in desc.shared.items()
    ]
    rows.append({"job": "report", "jobs run": 1, "as separate folders": n, "shared": "all runs"})
    df = pd.DataFrame(rows)
    df.attrs["caption"] = (
        "Each job runs once per distinct value of the keys its stage reads (and of the jobs it "
        "consumes); 'shared' lists the variants that serve several runs "
        "(results/variants/<variant>/)."
    )
    return df


# ----------------------------------------------------------------------------- build


def _img(fig: Figure, name: str, title: str, png: bytes) -> str:
    b64 = base64.b64encode(png).decode("ascii")
    return (
        f'<figure id="{name}"><img alt="{html.escape(title)}" src="data:image/png;base64,{b64}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
    )


def _table(df: pd.DataFrame) -> str:
    text = table_html(df)
    best = df.attrs.get("best")
    if best is None:
        return text
    # the best run's row in bold: its row is the (best+1)-th <tr> of the body
    head, body = text.split("<tbody>", 1)
    rows = body.split("</tr>")
    rows[best] = rows[best].replace("<tr>", '<tr class="best">', 1)
    return head + "<tbody>" + "</tr>".join(rows)


def build_sweep_report(
    results: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    runs: SweepDescription,
    formats=("png",),
    exclude_rules=("report",),
) -> list[Path]:
    """Write the sweep's comparison into `out_dir` and each run's report and run.json under
    results/runs/<run>/; returns the paths written (summary first)."""
    from distlm.report.build import build_report

    results, out_dir = Path(results), Path(out_dir)
    desc, varied = runs, runs.varied
    data = collect_runs(results, desc)
    written: list[Path] = []
    runs_root = results / RUNS[len(RESULTS) + 1 :]
    if runs_root.is_dir():  # the per-run view of runs no longer in the sweep (their variants stay)
        for gone in sorted(p for p in runs_root.iterdir() if p.name not in desc.runs):
            log.info("removing %s: run %r is no longer in the sweep", gone, gone.name)
            if gone.is_dir() and not gone.is_symlink():
                shutil.rmtree(gone)
            else:
                gone.unlink()
    for name, r in desc.runs.items():
        folder = results / run_dir(name)[len(RESULTS) + 1 :]
        doc = SweepRun(
            name=name,
            override=r.override,
            varied=r.varied,
            jobs={job: variant_folder(v) for job, v in r.variants.items()},
        )
        write_document(folder / "run.json", doc)
        written.append(folder / "run.json")
        values = ", ".join(f"{k} = {v}" for k, v in r.varied.items())
        written += build_report(
            results,
            folder / "report",
            formats=formats,
            exclude_rules=exclude_rules,
            layout=run_layout(r.variants),
            benchmark_files=run_benchmarks(results, r.variants),
            title=f"distlm sweep run {name}",
            preface=(
                f'<p class="meta"><a href="../../../report/{STAGES["report"].file("summary")}">'
                f"&larr; sweep report</a> &middot; {html.escape(values)}</p>"
            ),
        )
    blocks = []
    built = {
        "sweep_loss": figure_loss(data),
        "sweep_runs": table_runs(data, varied),
        "sweep_inference": figure_inference(data, varied),
        "sweep_jobs": table_jobs(desc),
    }
    for item in SWEEP_ITEMS:
        obj = built[item.name]
        if item.kind == "figure":
            why = (
                "no inference.* key varies across the runs"
                if item.name == "sweep_inference"
                and not any(k.startswith("inference.") for k in varied)
                else "no run has its metrics yet"
            )
            fig = obj if obj is not None else not_collected(item.title, why)
            png = _png(fig)
            for fmt in formats:
                _save(fig, out_dir / item.path(fmt), fmt, png)
                written.append(out_dir / item.path(fmt))
            if obj is not None:
                blocks.append(_img(fig, item.name, item.title, png))
        else:
            body = _table(obj)
            write_text(
                out_dir / item.path(),
                _page(item.title, f"<h3>{html.escape(item.title)}</h3>\n{body}"),
            )
            written.append(out_dir / item.path())
            blocks.append(f'<h3 id="{item.name}">{html.escape(item.title)}</h3>\n{body}')
    links = "".join(
        f'<li><a href="../runs/{html.escape(n)}/report/{STAGES["report"].file("summary")}">'
        f"{html.escape(n)}</a>: {html.escape(', '.join(f'{k} = {v}' for k, v in r.varied.items()))}"
        "</li>"
        for n, r in desc.runs.items()
    )
    parts = [
        "<h1>distlm sweep report</h1>",
        (
            f'<p class="meta">{len(desc.runs)} runs over one base config &middot; varied: '
            f"{html.escape(', '.join(varied) or 'nothing')} &middot; results folder "
            f"{html.escape(str(results.resolve()))} &middot; generated "
            f"{_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M UTC}</p>"
        ),
        f'<section id="sec-sweep"><h2>Sweep: the runs side by side</h2>{"".join(blocks)}</section>',
        f'<section id="sec-runs"><h2>Each run\'s report</h2><ul>{links}</ul></section>',
    ]
    summary = out_dir / STAGES["report"].file("summary")
    write_text(summary, _page("distlm sweep report", "\n".join(parts)))
    written.insert(0, summary)
    log.info("wrote %s (%d runs, varied: %s)", summary, len(desc.runs), ", ".join(varied))
    return written


def _page(title: str, body: str) -> str:
    css = _CSS + "table.data tr.best td{font-weight:700;background:#f1fbf1}\n"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{css}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )
