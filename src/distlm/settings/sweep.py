"""`sweep`: named runs over the base config (distlm.dag.sweep expands, validates and plans them)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from distlm.settings.base import Section

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # a run name is a folder name and a wildcard value
NAME_MAX = 80
DOTTED_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"


class SweepSettings(Section):
    """Named runs over this base config, each job run once per distinct setting of the keys its
    stage reads; results/variants/<variant>/ per job variant, results/runs/<run>/ per run
    (docs/sweeps.md). Absent: one run, with today's paths."""

    runs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Named runs: run name -> partial config merged over the base config "
        "(nested sections or dotted keys, `train.lr: 1e-3`). Names match "
        f"{NAME_PATTERN} (at most {NAME_MAX} characters): they are folder names.",
        json_schema_extra={
            "propertyNames": {"pattern": f"^{NAME_PATTERN}$", "maxLength": NAME_MAX}
        },
    )
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(
        default_factory=dict,
        description="Dotted key -> list of values; the cross product becomes runs named from "
        "the values (`train.lr: [1e-3, 5e-4]` x `inference.stages: [1, 2]` -> "
        "lr-0.001_stages-1, ...).",
        json_schema_extra={"propertyNames": {"pattern": f"^{DOTTED_PATTERN}$"}},
    )


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # absent means no sweep: Snakemake must not fill in `sweep: null`
