"""Profile reports: every stage's metrics -> pandas tables, matplotlib figures, one HTML summary.

    from distlm.report import build_report
    build_report("results", "results/report", formats=["png"])

writes results/report/summary.html (self-contained: figures embedded as base64, tables inline, opens
from disk), results/report/figures/<name>.<fmt> and results/report/tables/<name>.html. The
workflow's rule `report` registers each of them with Snakemake's `report()` (captions in
workflow/report/<name>.rst), so `snakemake --report report.html` shows them too.

An absent input (a stage not run, profiling off) gives a "not collected" note in the summary and a
figure or table that says so; a malformed metrics file raises ReportError naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distlm.report import figures as F
from distlm.report.inputs import LAYOUT, Inputs, ReportError, collect

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
    """One figure or table: its file stem, section, title, the inputs it needs, its builder."""

    name: str
    kind: str  # "figure" or "table"
    section: str
    title: str
    needs: tuple[str, ...]  # LAYOUT keys; the first absent one explains a missing item
    make: Callable[[Inputs], object]

    def path(self, fmt: str = "png") -> str:
        """Path relative to the report folder."""
        return f"figures/{self.name}.{fmt}" if self.kind == "figure" else f"tables/{self.name}.html"


ITEMS = (
    Item("data_splits", "table", "data", "Token counts per split", ("stats",), F.table_data),
    Item(
        "broadcast_gbps",
        "figure",
        "broadcast",
        "Broadcast GB/s per receiver and transport",
        ("broadcast",),
        F.broadcast,
    ),
    Item(
        "broadcast_receivers",
        "table",
        "broadcast",
        "Broadcast per receiver",
        ("broadcast",),
        F.table_broadcast,
    ),
    Item(
        "train_loss", "figure", "train", "Training loss and perplexity", ("metrics",), F.train_loss
    ),
    Item(
        "train_schedule",
        "figure",
        "train",
        "Learning rate and gradient norm",
        ("metrics",),
        F.train_schedule,
    ),
    Item("val_loss", "figure", "train", "Validation loss", ("val",), F.val_loss),
    Item(
        "train_summary",
        "table",
        "train",
        "Training metrics: first, last, min, max",
        ("metrics",),
        F.table_train,
    ),
    Item(
        "profile_ops", "figure", "train", "Top operators by self time", ("profile",), F.profile_ops
    ),
    Item(
        "profile_top_ops",
        "table",
        "train",
        "Profiler: top operators of the first rank",
        ("profile",),
        F.table_profile,
    ),
    Item(
        "perplexity",
        "figure",
        "eval",
        "Base against trained perplexity",
        ("eval_base", "eval_trained"),
        F.perplexity,
    ),
    Item(
        "eval_perplexity",
        "table",
        "eval",
        "Perplexity per model and split",
        ("eval_base", "eval_trained"),
        F.table_eval,
    ),
    Item(
        "inference",
        "figure",
        "inference",
        "Tokens/s and time to first token",
        ("timing",),
        F.inference,
    ),
    Item(
        "inference_timing",
        "table",
        "inference",
        "Inference timing per run",
        ("timing",),
        F.table_inference,
    ),
    Item(
        "inference_stages",
        "table",
        "inference",
        "Inference: where each stage's time went",
        ("timing",),
        F.table_stages,
    ),
    Item(
        "generations",
        "table",
        "inference",
        "Generated text (first prompts)",
        ("generations",),
        F.table_generations,
    ),
    Item(
        "rule_resources",
        "figure",
        "resources",
        "Wall time and peak memory per rule",
        ("benchmarks",),
        F.rule_resources,
    ),
    Item(
        "rule_benchmarks",
        "table",
        "resources",
        "Snakemake benchmark per rule",
        ("benchmarks",),
        F.table_resources,
    ),
)
FIGURES = tuple(i for i in ITEMS if i.kind == "figure")
TABLES = tuple(i for i in ITEMS if i.kind == "table")
SUMMARY = "summary.html"


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


from distlm.report.build import build_report

__all__ = [
    "FIGURES",
    "ITEMS",
    "LAYOUT",
    "SECTIONS",
    "SUMMARY",
    "TABLES",
    "Inputs",
    "Item",
    "ReportError",
    "build_report",
    "category",
    "collect",
    "outputs",
]
