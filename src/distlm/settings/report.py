"""`report`: the figures and the HTML summary."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from distlm.settings.base import Section, StageConfig
from distlm.settings.eval import unique


class ReportSettings(Section):
    formats: list[Literal["png", "svg"]] = Field(
        default=["png"],
        min_length=1,
        description="Formats of results/report/figures/<name>.<fmt>; summary.html embeds PNG.",
        json_schema_extra={"uniqueItems": True},
    )

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: list) -> list:
        return unique(v)


# ----------------------------------------------------------------------------- the stage's keys


class ReportConfig(StageConfig):
    STAGE: ClassVar[str] = "report"
    KIND: ClassVar[str] = "distlm-config-report"
    report: ReportSettings
