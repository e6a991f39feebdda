"""Which code a benchmark measured: the checkout's commit, and whether it had uncommitted changes,
recorded in every result file that the README's table reads (benchmarks/summary.py names it
beside each figure)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("src", "workflow", "Snakefile", "profiles", "benchmarks", "pyproject.toml")


def git_revision(root: Path = ROOT) -> str:
    """The checkout's commit, with " (with uncommitted changes)" when its code differs from it
    (the library, the workflow, the profiles, the benchmarks: not its documents); "" outside a
    git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False
        ).stdout.strip()

    rev = git("rev-parse", "HEAD")
    if not rev:
        return ""
    changed = git("status", "--porcelain", "--", *CODE)
    return rev + (" (with uncommitted changes)" if changed else "")


def main() -> None:
    import argparse

    argparse.ArgumentParser(
        description="Print the commit the benchmarks would record as measured (and whether the "
        "checkout's code differs from it)."
    ).parse_args()
    print(git_revision() or "(not a git checkout)")


if __name__ == "__main__":
    main()
