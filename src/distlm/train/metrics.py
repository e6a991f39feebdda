"""Training metrics: per-step and validation rows, CSV files and TensorBoard, on rank 0 only.

Rows are kept in memory and saved inside every checkpoint, so a resumed run continues the same
history; the CSV files are (re)written atomically at each checkpoint and at the end of the run.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from distlm.core.io import write_text
from distlm.core.log import get_logger

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = get_logger(__name__)

TRAIN_COLUMNS = (
    "step",
    "loss",
    "perplexity",
    "grad_norm",
    "lr",
    "tokens",
    "tokens_per_s",
    "step_time_s",  # end of the previous step to the end of this one: all the loop did between
    "data_wait_s",  # of it, waiting for rows from the token store (read ahead in the background)
)
VAL_COLUMNS = (
    "step",
    "val_loss",
    "val_perplexity",
    "tokens",
    "seconds",  # the validation's wall time: the first holds its one-time costs
)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def _csv(columns: tuple[str, ...], rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in columns})  # "": a column older rows lack
    return buf.getvalue()


def _tb_step(tb: SummaryWriter, row: dict) -> None:
    for k in ("loss", "perplexity", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        tb.add_scalar(f"train/{k}", row[k], row["step"])


def _tb_val(tb: SummaryWriter, row: dict) -> None:
    tb.add_scalar("val/loss", row["val_loss"], row["step"])
    tb.add_scalar("val/perplexity", row["val_perplexity"], row["step"])
    if "seconds" in row:
        tb.add_scalar("val/seconds", row["seconds"], row["step"])


class Metrics:
    """Collects rows; `enabled` (rank 0) also writes TensorBoard events and the CSV files."""

    def __init__(
        self,
        *,
        enabled: bool,
        metrics_csv: Path,
        val_csv: Path,
        tb_dir: Path | None,
        history: dict | None = None,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.metrics_csv = Path(metrics_csv)
        self.val_csv = Path(val_csv)
        self.train_rows: list[dict] = [
            r for r in (history or {}).get("train", []) if r["step"] <= start_step
        ]
        self.val_rows: list[dict] = [
            r for r in (history or {}).get("val", []) if r["step"] <= start_step
        ]
        self.tb_dir = tb_dir
        self._tb: SummaryWriter | None = None
        if enabled and tb_dir is not None:
            self._open_tb()

    def _open_tb(self) -> None:
        """TensorBoard is rebuilt from the history: events of a killed attempt past the
        checkpoint go, and a rerun that resumes (Snakemake cleared tb/) gets them all back."""
        from torch.utils.tensorboard import SummaryWriter

        assert self.tb_dir is not None
        shutil.rmtree(self.tb_dir, ignore_errors=True)
        self._tb = tb = SummaryWriter(str(self.tb_dir))
        for r in self.train_rows:
            _tb_step(tb, r)
        for r in self.val_rows:
            _tb_val(tb, r)

    def _tb_write(self, write: Callable[[SummaryWriter], None]) -> None:
        """A TensorBoard write; when its folder went away under the run (Snakemake removes the
        outputs of a job it thinks incomplete, e.g. a rerun after Snakemake was killed while this
        job runs on), the folder is rebuilt from the history and training goes on."""
        if self._tb is None:
            return
        try:
            write(self._tb)
        except OSError as e:
            log.warning(
                "TensorBoard events in %s cannot be written (%s): rebuilding the folder from the "
                "metric history",
                self.tb_dir,
                e,
            )
            with contextlib.suppress(Exception):
                self._tb.close()
            self._open_tb()

    def log_step(self, row: dict) -> None:
        self.train_rows.append(row)
        self._tb_write(lambda tb: _tb_step(tb, row))

    def log_val(self, row: dict) -> None:
        self.val_rows.append(row)
        self._tb_write(lambda tb: _tb_val(tb, row))

    def history(self) -> dict:
        return {"train": list(self.train_rows), "val": list(self.val_rows)}

    def flush(self) -> None:
        """Rewrite both CSV files atomically (rank 0) and flush TensorBoard."""
        if not self.enabled:
            return
        write_text(self.metrics_csv, _csv(TRAIN_COLUMNS, self.train_rows))
        write_text(self.val_csv, _csv(VAL_COLUMNS, self.val_rows))
        self._tb_write(lambda tb: tb.flush())

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:  # the next start rebuilds the events from the checkpoint
                log.warning("TensorBoard events in %s not closed cleanly: %s", self.tb_dir, e)
            self._tb = None
