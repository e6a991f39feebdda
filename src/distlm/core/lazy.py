"""A package's names imported when first asked for (PEP 562): its `__init__` names where each
lives, and the module is imported on first use, so that a light reader of the package (the
workflow while it plans the DAG, the report, distlm-launch) does not import torch with it.

    __getattr__ = lazy_names(__name__, {"write_tokens": "distlm.data.tokens", ...})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name of `where` is imported from its module when
    first asked for; any other is an AttributeError, as for any module."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
