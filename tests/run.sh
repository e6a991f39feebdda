#!/usr/bin/env bash
# The test command (README "Set-up: two commands"): installs the Debian packages that the system-level tests need
# when run as root (network namespaces, a local SLURM cluster, headless Chromium), runs the linters
# (ruff check, ruff format --check, snakefmt --check, snakemake --lint), the type checker (pyright, beside the tests)
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

# Lint first (seconds), then the tests, so that pytest's summary is the last thing printed. The
# type checker (pyright, ~20 s of one core) runs beside the rest; its output is shown after the
# tests' (pyright_result).
lint_failed=0
echo "tests/run.sh: lint (ruff check, ruff format --check, snakefmt --check, snakemake --lint, lint-imports; pyright beside the tests)"
pyright_log=$(mktemp)
python -m pyright >"$pyright_log" 2>&1 &
pyright_pid=$!
pyright_result() {
  local rc=0
  wait "$pyright_pid" || rc=$?
  echo
  echo "tests/run.sh: pyright (run beside the tests):"
  cat "$pyright_log"
  rm -f "$pyright_log"
  [ "$rc" = 0 ] || lint_failed=1
}
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
lint-imports --no-cache || lint_failed=1  # the layers ([tool.importlinter] in pyproject.toml)
[ "$lint_failed" = 0 ] || echo "tests/run.sh: lint failed (see above); running the tests anyway" >&2

# The SLURM tests mostly wait on the local cluster's scheduler and its time limits: they run in two
# more pytest sessions beside the others (the requeue tests, marker slurm_requeue, in one; the
# other SLURM tests in the other), each with a SLURM cluster of its own; their output follows the
# others'. The sessions share one run of the tiny workflow, and the SLURM sessions one build of
# their data and base model (DISTLM_TESTS_WORKFLOW; tests/conftest.py: _once_per_run). With a -m of
# the caller's, or DISTLM_TESTS_SERIAL=1, one pytest runs everything as given.
status=0
if [ "${DISTLM_TESTS_SERIAL:-0}" = 1 ] || printf '%s\n' "$@" | grep -qx -- '-m.*\|--markexpr.*'; then
  python -m pytest "$@" || status=$?
  pyright_result
else
  scratch=$(mktemp -d)
  export DISTLM_TESTS_WORKFLOW="$scratch"
  names=(rest slurm requeue)
  # with_slurm, with_requeue: long tests moved into the SLURM sessions (which mostly
  # wait), so that the three sessions end about together
  marks=(
    "not slurm and not with_slurm and not with_requeue"
    "(slurm and not slurm_requeue and not with_requeue) or with_slurm"
    "slurm_requeue or with_requeue"
  )
  pids=()
  python -m pytest -m "${marks[0]}" "$@" &
  pids+=($!)
  for i in 1 2; do
    python -m pytest -m "${marks[$i]}" -o "cache_dir=.pytest_cache/${names[$i]}" "$@" \
      >"$scratch/${names[$i]}.log" 2>&1 &
    pids+=($!)
  done
  show() {
    for i in 1 2; do
      echo
      echo "tests/run.sh: pytest -m '${marks[$i]}' (run beside the others):"
      cat "$scratch/${names[$i]}.log"
    done
  }
  # Ctrl-C reaches every session (one process group); a TERM is passed on as an interrupt, so
  # each session stops its servers and its cluster before it exits
  stop() {
    [ "$1" = INT ] || kill -INT "${pids[@]}" "$pyright_pid" 2>/dev/null
    wait "${pids[@]}"
    pyright_result
    show
    rm -rf "$scratch"
    exit 130
  }
  trap 'stop INT' INT
  trap 'stop TERM' TERM
  codes=()
  for pid in "${pids[@]}"; do
    rc=0
    wait "$pid" || rc=$?
    codes+=("$rc")
  done
  trap - INT TERM
  pyright_result
  show
  rm -rf "$scratch"
  # 5: no test collected, as when the arguments select none of a session's tests
  status=5
  for rc in "${codes[@]}"; do
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
      status=$rc
      break
    fi
    [ "$rc" = 5 ] || status=0
  done
  echo "tests/run.sh: exit codes: ${names[0]} ${codes[0]}, ${names[1]} ${codes[1]}, ${names[2]} ${codes[2]}"
fi
if [ "$lint_failed" != 0 ]; then
  echo "tests/run.sh: lint failed" >&2
  [ "$status" != 0 ] || status=1
fi
exit "$status"
