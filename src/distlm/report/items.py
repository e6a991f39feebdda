"""The report's items, declared once: file names, sections, titles and the inputs each needs.

The workflow reads this module while it builds the DAG (the report rule's outputs and their
`report()` captions), so it imports nothing heavy; the builders live in `figures.BUILDERS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlm.dag.stages import STAGES

# Report sections in reading order: key -> heading (also the category in `snakemake --report`).
SECTIONS = {
    "data": "Dataset",
    "broadcast": "Weight broadcast",
    "train": "Training",
    "eval": "Evaluation",
    "inference": "Pipeline inference",
    "resources": "Wall time and memory per rule",
}


@dataclass(frozen=True)
class Item:
    """One figure or table: its file stem, section, title and the inputs it needs (its builder
    is `distlm.report.figures.BUILDERS[name]`)."""

    name: str
    kind: str  # "figure" or "table"
    section: str
    title: str
    needs: tuple[str, ...]  # LAYOUT keys; the first absent one explains a missing item

    def path(self, fmt: str = "png") -> str:
        """Path relative to the report folder."""
        return f"figures/{self.name}.{fmt}" if self.kind == "figure" else f"tables/{self.name}.html"


ITEMS = (
    Item(
        "data_splits",
        "table",
        "data",
        "Token counts per split (and how each was made), then per shard (and its job's rate)",
        ("stats",),
    ),
    Item(
        "broadcast_gbps",
        "figure",
        "broadcast",
        "Broadcast GB/s per receiver and transport",
        ("broadcast",),
    ),
    Item("broadcast_receivers", "table", "broadcast", "Broadcast per receiver", ("broadcast",)),
    Item("train_loss", "figure", "train", "Training loss and perplexity", ("metrics",)),
    Item("train_schedule", "figure", "train", "Learning rate and gradient norm", ("metrics",)),
    Item("val_loss", "figure", "train", "Validation loss", ("val",)),
    Item(
        "train_summary", "table", "train", "Training metrics: first, last, min, max", ("metrics",)
    ),
    Item("profile_ops", "figure", "train", "Top operators by self time", ("profile",)),
    Item(
        "profile_top_ops",
        "table",
        "train",
        "Profiler: top operators of the first rank",
        ("profile",),
    ),
    Item(
        "perplexity",
        "figure",
        "eval",
        "Base against trained perplexity",
        ("eval_base", "eval_trained"),
    ),
    Item(
        "eval_perplexity",
        "table",
        "eval",
        "Perplexity per model and split",
        ("eval_base", "eval_trained"),
    ),
    Item("inference", "figure", "inference", "Tokens/s and time to first token", ("timing",)),
    Item("inference_timing", "table", "inference", "Inference timing per run", ("timing",)),
    Item(
        "inference_stages",
        "table",
        "inference",
        "Inference: where each stage's time went",
        ("timing",),
    ),
    Item("generations", "table", "inference", "Generated text (first prompts)", ("generations",)),
    Item(
        "rule_resources",
        "figure",
        "resources",
        "Wall time and peak memory per rule",
        ("benchmarks",),
    ),
    Item("rule_benchmarks", "table", "resources", "Snakemake benchmark per rule", ("benchmarks",)),
)
FIGURES = tuple(i for i in ITEMS if i.kind == "figure")
TABLES = tuple(i for i in ITEMS if i.kind == "table")
SUMMARY = STAGES["report"].file("summary")


def category(section: str) -> str:
    """The `snakemake --report` category of a section: numbered so they sort in reading order."""
    return f"{list(SECTIONS).index(section) + 1}. {SECTIONS[section]}"


def outputs(formats=("png",)) -> list[tuple[Item, str]]:
    """Every (item, path relative to the report folder) build_report writes, summary excluded."""
    return [
        (item, item.path(fmt))
        for item in ITEMS
        for fmt in (formats if item.kind == "figure" else ("html",))
    ]


# The comparison of a sweep's runs (distlm.report.compare), results/report/<kind>s/<name>.<fmt>.
@dataclass(frozen=True)
class SweepItem:
    """One figure or table of the sweep comparison (results/report/<kind>s/<name>.<fmt>)."""

    name: str
    kind: str
    title: str

    def path(self, fmt: str = "png") -> str:
        return f"figures/{self.name}.{fmt}" if self.kind == "figure" else f"tables/{self.name}.html"


SWEEP_ITEMS = (
    SweepItem("sweep_loss", "figure", "Validation loss of every run (train loss faint)"),
    SweepItem("sweep_runs", "table", "Runs: varied keys, results, cost; best run marked"),
    SweepItem("sweep_inference", "figure", "Inference tokens/s and time to first token per run"),
    SweepItem("sweep_jobs", "table", "Jobs: variants run, shared between runs"),
)
SWEEP_SECTION = "0. Sweep"  # its `snakemake --report` category


def sweep_outputs(formats=("png",)) -> list[tuple[SweepItem, str]]:
    """Every (item, path relative to the report folder) of the comparison, summary excluded."""
    return [
        (i, i.path(f)) for i in SWEEP_ITEMS for f in (formats if i.kind == "figure" else ("html",))
    ]
