"""Checkpoint evaluation: `stage` (sliding-window perplexity, windows split across ranks) and its
report (`documents`: EvalReport)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distlm.evaluate.stage import (
        check_data_matches,
        evaluate_model,
        evaluate_stream,
        load_model,
        resolve_window,
        sliding_windows,
    )

# The stage, imported when first asked for (PEP 562): its documents (distlm.evaluate.documents)
# are read without torch.
_STAGE = "distlm.evaluate.stage"


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(_STAGE), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "check_data_matches",
    "evaluate_model",
    "evaluate_stream",
    "load_model",
    "resolve_window",
    "sliding_windows",
]
