"""The weight-broadcast stage: `stage` (rank 0 sends the model through distlm.transfer, every
receiver verifies) and its report (`documents`: BroadcastReport)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distlm.broadcast.stage import run_broadcast_stage

# The stage, imported when first asked for (PEP 562): its documents (distlm.broadcast.documents)
# are read without torch.
_STAGE = "distlm.broadcast.stage"


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(_STAGE), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["run_broadcast_stage"]
