"""`python -m distlm.settings --check|--write`: workflow/schemas/config.schema.yaml in sync with
the models (run in the checkout's root, or give --root)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distlm.settings.schema import SCHEMA_FILE, schema_yaml


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlm.settings", description=__doc__)
    p.add_argument("--write", action="store_true", help=f"rewrite {SCHEMA_FILE}")
    p.add_argument("--check", action="store_true", help=f"exit 1 when {SCHEMA_FILE} is stale")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout (default: .)")
    args = p.parse_args(argv)
    path = args.root / SCHEMA_FILE
    new = schema_yaml()
    if args.write:
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        if new != old:
            from distlm.core.io import write_text

            write_text(path, new)
        return 0
    if args.check:
        try:
            old = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            old = None
        if new != old:
            print(
                f"{path}: out of date with src/distlm/settings; run "
                "`python -m distlm.settings --write`",
                file=sys.stderr,
            )
            return 1
        return 0
    print(new, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
