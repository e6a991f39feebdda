"""Which code a benchmark measured: the checkout's commit, and whether it had uncommitted changes,
recorded in every result file that the README's table reads (benchmarks/summary.py names it
beside each figure)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_revision(root: Path = ROOT) -> str:
    """The checkout's commit, with " (with uncommitted changes)" when its tree differs from it;
    "" outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False
        ).stdout.strip()

    rev = git("rev-parse", "HEAD")
    if not rev:
        return ""
    return rev + (" (with uncommitted changes)" if git("status", "--porcelain") else "")
