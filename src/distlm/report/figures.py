"""Matplotlib figures and pandas tables of the report, one function per item.

Every function takes the collected `Inputs` and returns a Figure (or a DataFrame), or None when
its input was not collected. Figures use the object API (`matplotlib.figure.Figure`), never
pyplot, so nothing depends on a display or on global state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from distlm.report.inputs import Inputs

_PANEL = (5.6, 3.6)  # inches per subplot
_TRAIN, _VAL, _BASE, _TRAINED = "#1f77b4", "#d62728", "#7f7f7f", "#2ca02c"


def _figure(nrows: int, ncols: int, title: str) -> tuple[Figure, list]:
    fig = Figure(figsize=(_PANEL[0] * ncols, _PANEL[1] * nrows + 0.5), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    fig.suptitle(title, fontsize=14, fontweight="bold")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=10)
    return fig, axes


def _note(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        wrap=True,
        fontsize=11,
        color="#a33",
        transform=ax.transAxes,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def not_collected(title: str, reason: str) -> Figure:
    """The figure written in place of one whose input is absent, so the file exists and says why."""
    fig = Figure(figsize=(8, 2.6), layout="constrained")
    ax = fig.subplots()
    ax.axis("off")
    ax.text(
        0.5,
        0.68,
        f"{title}: not collected",
        ha="center",
        va="center",
        fontsize=15,
        fontweight="bold",
        color="#a33",
        transform=ax.transAxes,
    )
    ax.text(
        0.5,
        0.32,
        reason.removeprefix("not collected: "),
        ha="center",
        va="center",
        fontsize=10,
        wrap=True,
        transform=ax.transAxes,
    )
    return fig


# ----------------------------------------------------------------------------- training


def train_loss(inp: Inputs) -> Figure | None:
    m = inp.metrics
    if m is None:
        return None
    fig, axes = _figure(2, 2, "Training loss and perplexity")
    has_tokens = "tokens" in m
    for row, (col, label) in enumerate((("loss", "loss (nats/token)"), ("ppl", "perplexity"))):
        for c, x in enumerate(("step", "tokens")):
            ax = axes[2 * row + c]
            if x == "tokens" and not has_tokens:
                _note(ax, "not collected: metrics.csv has no tokens column")
                continue
            ax.plot(m[x], m[col], color=_TRAIN, lw=1.6, label="train")
            v = inp.val
            if v is not None and x == "step":
                ax.plot(v["step"], v["val_" + col], "o-", color=_VAL, label="validation")
            elif v is not None and "tokens" in v:
                ax.plot(v["tokens"], v["val_" + col], "o-", color=_VAL, label="validation")
            ax.set_xlabel("optimizer step" if x == "step" else "tokens seen (all ranks)")
            ax.set_ylabel(label)
            if col == "ppl" and m[col].max() / max(m[col].min(), 1e-9) > 20:
                ax.set_yscale("log")
            if x == "tokens":
                ax.xaxis.set_major_formatter(EngFormatter())
            ax.legend(fontsize=9)
    return fig


def train_schedule(inp: Inputs) -> Figure | None:
    m = inp.metrics
    if m is None:
        return None
    fig, axes = _figure(1, 3, "Learning rate, gradient norm and throughput")
    for ax, col, label in (
        (axes[0], "lr", "learning rate"),
        (axes[1], "grad_norm", "gradient L2 norm (before clipping)"),
        (axes[2], "tokens_per_s", "training tokens/s (all ranks)"),
    ):
        if col not in m:
            _note(ax, f"not collected: metrics.csv has no {col} column")
            continue
        ax.plot(m["step"], m[col], color=_TRAIN, lw=1.6)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        if col == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    return fig


def val_loss(inp: Inputs) -> Figure | None:
    v = inp.val
    if v is None:
        return None
    fig, axes = _figure(1, 2, "Validation during training")
    for ax, col, label in (
        (axes[0], "val_loss", "loss (nats/token)"),
        (axes[1], "val_ppl", "perplexity"),
    ):
        ax.plot(v["step"], v[col], "o-", color=_VAL, lw=1.6, label="validation")
        if inp.metrics is not None:
            ax.plot(
                inp.metrics["step"],
                inp.metrics[col.removeprefix("val_")],
                color=_TRAIN,
                lw=1,
                alpha=0.6,
                label="train",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.legend(fontsize=9)
    return fig


def profile_ops(inp: Inputs, top: int = 15) -> Figure | None:
    p = inp.profile
    if p is None:
        return None
    # a rank's rows of one name together: on a GPU torch's key_averages() keeps an operator's CPU
    # and device events (and a range's) apart, under the same name
    per_rank = p.groupby(["rank", "operator"])["self_ms"].sum()
    mean = per_rank.groupby("operator").mean().sort_values(ascending=False).head(top)
    ops = list(mean.index[::-1])  # largest at the top
    ranks = sorted(p["rank"].unique())
    fig = Figure(figsize=(11, 0.42 * len(ops) * max(1, len(ranks) / 2) + 1.8), layout="constrained")
    ax = fig.subplots()
    h = 0.8 / len(ranks)
    for i, r in enumerate(ranks):
        d = per_rank[r].reindex(ops).fillna(0)
        ys = [j - (i - (len(ranks) - 1) / 2) * h for j in range(len(ops))]  # rank 0 on top
        ax.barh(ys, d.values, h, label=f"rank {r}")
    ax.set_yticks(range(len(ops)), [o if len(o) <= 48 else o[:45] + "..." for o in ops])
    w = p.attrs.get("window") or {}
    active = f", {w['active']} profiled step(s)" if "active" in w else ""
    ax.set_xlabel(f"{p.attrs.get('sort_by', 'self time')} (ms{active})")
    ax.set_title(
        f"Top {len(ops)} operators by {p.attrs.get('sort_by', 'self time')}",
        fontsize=14,
        fontweight="bold",
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9)
    return fig


# ----------------------------------------------------------------------------- other stages


def broadcast(inp: Inputs) -> Figure | None:
    r = inp.receivers
    if r is None:
        return None
    fig, axes = _figure(1, 2, "Weight broadcast throughput")
    labels = [f"{t}\nrank {k}" for t, k in zip(r["transport"], r["receiver"])]
    transports = list(dict.fromkeys(r["transport"]))
    colors = {t: f"C{i % 10}" for i, t in enumerate(transports)}
    axes[0].bar(labels, r["gbps"], color=[colors[t] for t in r["transport"]])
    axes[0].set_ylabel("GB/s")
    axes[0].set_title("per receiver", fontsize=11)
    per = r.groupby("transport", sort=False)["gbps"].agg(["mean", "min", "max"])
    axes[1].bar(
        per.index,
        per["mean"],
        color=[colors[t] for t in per.index],
        yerr=[per["mean"] - per["min"], per["max"] - per["mean"]],
        capsize=6,
    )
    if r["all_gbps"].notna().any():
        overall = r.groupby("transport", sort=False)["all_gbps"].first()
        axes[1].plot(
            overall.index, overall.values, "kD", ms=9, label="all receivers done (sender's clock)"
        )
        axes[1].legend(fontsize=9, loc="upper center")
    for ax in axes:
        ax.set_ylim(0, pd.concat([r["gbps"], r["all_gbps"]]).max() * 1.25)  # room for the legend
    axes[1].set_ylabel("GB/s (mean, min-max over receivers)")
    axes[1].set_title("per transport", fontsize=11)
    return fig


def perplexity(inp: Inputs) -> Figure | None:
    e = inp.evals
    if e is None:
        return None
    fig, axes = _figure(1, 1, "Perplexity: base against trained model")
    fig.set_size_inches(7.5, _PANEL[1] + 0.5)
    ax = axes[0]
    splits = list(dict.fromkeys(e["split"]))
    models = list(dict.fromkeys(e["model"]))
    w = 0.8 / len(models)
    for i, model in enumerate(models):
        d = e[e["model"] == model].set_index("split").reindex(splits)
        xs = [j + (i - (len(models) - 1) / 2) * w for j in range(len(splits))]
        bars = ax.bar(
            xs, d["perplexity"], w, label=model, color=_BASE if model == "base" else _TRAINED
        )
        ax.bar_label(bars, fmt="%.1f", fontsize=9)
    ax.set_xticks(range(len(splits)), splits)
    ax.set_ylabel("perplexity (lower is better)")
    if e["perplexity"].max() / max(e["perplexity"].min(), 1e-9) > 20:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, e["perplexity"].max() * 1.2)  # room for the labels and the legend
    ax.legend(ncols=len(models), loc="upper center")
    return fig


def inference(inp: Inputs) -> Figure | None:
    t = inp.inference
    if t is None:
        return None
    fig, axes = _figure(2, 2, "Pipeline inference")
    for ax, col, label in (
        (axes[0], "tokens_per_s", "generated tokens/s (all prompts)"),
        (axes[1], "ttft_mean_s", "time to first token (s), mean and max"),
    ):
        for lanes, d in t.sort_values("stages").groupby("lanes"):
            yerr = (
                [[0] * len(d), d["ttft_max_s"] - d["ttft_mean_s"]] if col == "ttft_mean_s" else None
            )
            ax.errorbar(
                d["stages"],
                d[col],
                yerr=yerr,
                fmt="o-",
                capsize=5,
                label=f"{lanes} prompt(s) in flight",
            )
        ax.set_xlabel("pipeline stages (MPI ranks)")
        ax.set_xticks(sorted(t["stages"].unique()))
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=9)
    p, lanes = inp.prompts, int(t["lanes"].iloc[-1])
    ax = axes[2]
    if p is None:
        _note(ax, "not collected: timing.json has no per_prompt timing")
    else:
        ax.bar(p["index"], p["ttft_s"], color=_TRAIN, label="time to first token")
        if "queue_s" in p:
            ax.bar(p["index"], p["queue_s"], color="#ff7f0e", label="of which queued for a lane")
        ax.set_ylim(0, p["ttft_s"].max() * 1.3)
        ax.set_xlabel(f"prompt (submitted together; {lanes} in flight at a time)")
        ax.set_ylabel("seconds")
        ax.set_xticks(list(p["index"]))
        ax.legend(fontsize=9)
    ax = axes[3]
    st = inp.stages
    if st is None:
        _note(ax, "not collected: timing.json has no per_stage timing")
    else:
        bottom = pd.Series(0.0, index=st.index)
        for col, label, color in (
            ("compute_s", "forward", _TRAIN),
            ("send_s", "send", "#ff7f0e"),
            ("recv_wait_s", "waiting to receive", "#9467bd"),
        ):
            if col in st:
                ax.bar(st["stage"], st[col], bottom=bottom, color=color, label=label)
                bottom = bottom + st[col]
        ax.set_ylim(0, bottom.max() * 1.3)  # room for the legend
        ax.set_xlabel("pipeline stage (last run)")
        ax.set_xticks(list(st["stage"]))
        ax.set_ylabel("seconds")
        ax.legend(fontsize=9)
    return fig


def rule_resources(inp: Inputs) -> Figure | None:
    b = inp.benchmarks
    if b is None:
        return None
    d = b.iloc[::-1]
    fig = Figure(figsize=(11, 0.42 * len(d) + 1.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    fig.suptitle(
        "Wall time and peak memory per rule (Snakemake benchmark)", fontsize=14, fontweight="bold"
    )
    axes[0].barh(d["rule"], d["wall_s"], color=_TRAIN)
    axes[0].set_xlabel("wall time (s)")
    axes[1].barh(d["rule"], d["max_rss_mb"].fillna(0), color="#ff7f0e")
    axes[1].set_xlabel("peak RSS (MB)")
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
    return fig


# ----------------------------------------------------------------------------- tables


def _fmt_bytes(n: float) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def table_data(inp: Inputs) -> pd.DataFrame | None:
    return inp.splits


def table_broadcast(inp: Inputs) -> pd.DataFrame | None:
    if inp.receivers is None:
        return None
    r = inp.receivers.copy()
    r["bytes"] = r["bytes"].map(_fmt_bytes)
    return r.drop(columns=["all_gbps"]).rename(columns={"gbps": "GB/s"})


def table_train(inp: Inputs) -> pd.DataFrame | None:
    m = inp.metrics
    if m is None:
        return None
    rows = []
    for col in [
        c
        for c in ("loss", "ppl", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s")
        if c in m
    ]:
        rows.append(
            {
                "metric": col,
                "first": m[col].iloc[0],
                "last": m[col].iloc[-1],
                "min": m[col].min(),
                "max": m[col].max(),
            }
        )
    if inp.val is not None:
        for col in ("val_loss", "val_ppl"):
            v = inp.val[col]
            rows.append(
                {
                    "metric": col,
                    "first": v.iloc[0],
                    "last": v.iloc[-1],
                    "min": v.min(),
                    "max": v.max(),
                }
            )
    out = pd.DataFrame(rows)
    out.attrs["caption"] = (
        f"{len(m)} logged steps, steps {int(m['step'].iloc[0])}-{int(m['step'].iloc[-1])}"
    )
    return out


def table_profile(inp: Inputs, top: int = 25) -> pd.DataFrame | None:
    if inp.profile is None:
        return None
    p = inp.profile
    rank = p["rank"].min()
    out = p[p["rank"] == rank].drop(columns=["rank"]).head(top).reset_index(drop=True)
    order = p.attrs.get("sort_by", "self time")
    out.attrs["caption"] = f"rank {rank}; times in ms over the profiled steps, sorted by {order}"
    return out


def table_eval(inp: Inputs) -> pd.DataFrame | None:
    e = inp.evals
    if e is None:
        return None
    out = e.copy()
    if set(e["model"]) >= {"base", "trained"}:
        base = e[e["model"] == "base"].set_index("split")["perplexity"]
        out["vs base"] = [
            f"{p / base[s]:.3f}x" if s in base else ""
            for s, p in zip(out["split"], out["perplexity"])
        ]
    return out


def table_inference(inp: Inputs) -> pd.DataFrame | None:
    return inp.inference


def table_stages(inp: Inputs) -> pd.DataFrame | None:
    return inp.stages


def table_generations(inp: Inputs) -> pd.DataFrame | None:
    return inp.generations


def table_resources(inp: Inputs) -> pd.DataFrame | None:
    return inp.benchmarks


# The builder of every report item (distlm.report.items.ITEMS), by item name.
BUILDERS: dict[str, Callable[[Inputs], object]] = {
    "data_splits": table_data,
    "broadcast_gbps": broadcast,
    "broadcast_receivers": table_broadcast,
    "train_loss": train_loss,
    "train_schedule": train_schedule,
    "val_loss": val_loss,
    "train_summary": table_train,
    "profile_ops": profile_ops,
    "profile_top_ops": table_profile,
    "perplexity": perplexity,
    "eval_perplexity": table_eval,
    "inference": inference,
    "inference_timing": table_inference,
    "inference_stages": table_stages,
    "generations": table_generations,
    "rule_resources": rule_resources,
    "rule_benchmarks": table_resources,
}
