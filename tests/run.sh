#!/usr/bin/env bash
# The test command (README "Set-up: two commands"): installs the Debian packages that the system-level tests need
# when run as root (network namespaces, a local SLURM cluster, headless Chromium), runs the linters
# (ruff check, ruff format --check, snakefmt --check, snakemake --lint), the type checker (pyright)
# and the import layers (lint-imports), both configured in pyproject.toml, then pytest (the SLURM
# tests in a second pytest beside the others, see below); it fails when either does. Arguments are passed to pytest, e.g. `bash tests/run.sh -k data -x`; the fast
# development loop is `python -m pytest -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(iproute2 util-linux slurm-wlm munge chromium fonts-liberation)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "tests/run.sh: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
else
  echo "tests/run.sh: not root (or no apt-get): tests that need ${DEBIAN_PACKAGES[*]} skip if absent"
fi

# Lint first (seconds), then the tests, so that pytest's summary is the last thing printed.
lint_failed=0
echo "tests/run.sh: lint (ruff check, ruff format --check, snakefmt --check, snakemake --lint, pyright, lint-imports)"
python -m ruff check || lint_failed=1
python -m ruff format --check || lint_failed=1
python -m snakefmt --check Snakefile workflow/rules/*.smk || lint_failed=1
lintdir=$(mktemp -d)
python -m snakemake --lint --directory "$lintdir" -s Snakefile >"$lintdir/lint.txt" 2>&1 || lint_failed=1
grep -q "Congratulations" "$lintdir/lint.txt" || { cat "$lintdir/lint.txt"; lint_failed=1; }
# ... and the DAG of a sweep (config/sweep.yaml: every rule with its {variant} wildcard)
python -m snakemake --lint --directory "$lintdir" -s Snakefile --configfile config/sweep.yaml \
  >"$lintdir/lint-sweep.txt" 2>&1 || lint_failed=1
grep -q "Congratulations" "$lintdir/lint-sweep.txt" || { cat "$lintdir/lint-sweep.txt"; lint_failed=1; }
rm -rf "$lintdir"
python -m pyright || lint_failed=1
lint-imports --no-cache || lint_failed=1  # the layers ([tool.importlinter] in pyproject.toml)
[ "$lint_failed" = 0 ] || echo "tests/run.sh: lint failed (see above); running the tests anyway" >&2

# The SLURM tests (marker slurm) mostly wait on the local cluster's scheduler and its time limits:
# they run in a second pytest beside the others, whose summary is printed after theirs. With a
# -m of the caller's, or DISTLM_TESTS_SERIAL=1, one pytest runs everything as given.
status=0
if [ "${DISTLM_TESTS_SERIAL:-0}" = 1 ] || printf '%s\n' "$@" | grep -qx -- '-m\|-m.*\|--markexpr.*'; then
  python -m pytest "$@" || status=$?
else
  slurm_log=$(mktemp)
  python -m pytest -m slurm -o cache_dir=.pytest_cache/slurm "$@" >"$slurm_log" 2>&1 &
  slurm_pid=$!
  trap 'kill -INT "$slurm_pid" 2>/dev/null; wait "$slurm_pid"; rm -f "$slurm_log"' INT TERM
  rest=0
  python -m pytest -m "not slurm" "$@" || rest=$?
  slurm=0
  wait "$slurm_pid" || slurm=$?
  trap - INT TERM
  echo
  echo "tests/run.sh: the SLURM tests (pytest -m slurm, run beside the others):"
  cat "$slurm_log"
  rm -f "$slurm_log"
  # 5: no test collected, as when the arguments select none of one half
  if [ "$rest" = 5 ] && [ "$slurm" = 5 ]; then
    status=5
  elif [ "$rest" != 0 ] && [ "$rest" != 5 ]; then
    status=$rest
  elif [ "$slurm" != 0 ] && [ "$slurm" != 5 ]; then
    status=$slurm
  fi
  echo "tests/run.sh: pytest -m 'not slurm' exit $rest, pytest -m slurm exit $slurm"
fi
if [ "$lint_failed" != 0 ]; then
  echo "tests/run.sh: lint failed" >&2
  [ "$status" != 0 ] || status=1
fi
exit "$status"
