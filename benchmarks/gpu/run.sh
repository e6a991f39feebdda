#!/usr/bin/env bash
# One command that checks a GPU machine: installs distlm from a folder of wheels, runs the whole
# workflow on config/gpu.yaml, the `gpu` tests, and the training and serving benchmarks on CUDA,
# and writes what it measured under $OUT.
#
#   bash benchmarks/gpu/wheels.sh .whl          # on a machine with PyPI: the wheels (docs/performance.md, "GPU")
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh .whl [STEP...]
#
# STEPs name the steps to run after the install, in the order given (default: all of them, in
# the order below). A session lent a machine here has 15 minutes of device time, the machine's start
# included, and one call runs at most 10 minutes; the figures still missing go first:
#   OUT=... bash benchmarks/gpu/run.sh .whl workflow train infer tests                # ~9 min
#   OUT=... BUDGET_S=200 bash benchmarks/gpu/run.sh .whl workflow train-smollm2 serve  # ~3 min
# the second at once after the first, on the same warm machine: the work folder (GPU_WORK,
# /tmp/distlm-gpu) stays, so its workflow step finds the run finished and reruns nothing (what the
# user's second `snakemake` does), and serve and infer use its trained folder.
#
# For a machine with Python 3.12 and a CUDA build of torch already installed and no network (the
# GPU machines lent here: torch 2.11 with CUDA 13): every other package comes from the wheel folder
# (`pip install --no-index --no-deps`), distlm itself as an editable install. Each step has a time
# limit, and together they keep to a budget (BUDGET_S, 530 s): a step that fails or runs out of
# time is written down and the next one still runs. torch.compile's caches are what a user gets:
# the stages keep theirs with the run, and each benchmark job starts from empty ones, so the
# one-time costs are a first run's.
#   install     the wheels and distlm (always first)
#   workflow    snakemake --profile profiles/local --configfile config/gpu.yaml (rule all)
#   tests       pytest -m gpu, reading the workflow's run (DISTLM_TESTS_GPU_WORKFLOW)
#   train       benchmarks/train/bench_train.py --preset gpt2 --device cuda: the stage, compiled,
#               beside the nanoGPT-style compiled loop (GPT-2 small's real shape, bf16); steady-
#               state MFU of both, one-time costs (compile, first validation, checkpoint stalls:
#               three saves, at steps 20, 40 and 60)
#   train-smollm2  the same for the stage alone on SmolLM2-135M's shape (--preset smollm2): the
#               Llama family's MFU, its compile and checkpoint stalls
#   serve       benchmarks/inference/bench_serve.py --device cuda: distlm serve beside
#               `transformers serve --continuous-batching --device cuda`, on the trained folder
#   infer       benchmarks/inference/bench.py --device cuda: batch inference, the one-stage
#               pipeline with 32 prompts in flight beside transformers' batched `generate` on the
#               GPU, on the trained folder (--batch-only: those two rows timed); greedy ids
#               compared with `generate`'s, one prompt at a time, untimed
#   uccl        the broadcast stage with transfer.transport: uccl, when a uccl wheel is in the
#               folder and the machine has two GPUs (UCCL moves GPU memory between two of them)
# Files under $OUT (default benchmarks/gpu/out): summary.json (each step: command, exit code,
# seconds; the machine and the versions), run.log (everything printed), workflow-gpu.json (the
# workflow's reports: broadcast, evaluation, training record and its one-time costs, inference
# timing, per-rule wall time), pytest-gpu.txt, train-results-gpu.json,
# train-results-gpu-smollm2.json, serve-results-gpu.json, infer-results-gpu.json,
# broadcast-uccl.json (9 with every step: the device tool brings 8 a call, so use two calls).
# The figures are committed as benchmarks/train/results-gpu.json, results-gpu-smollm2.json,
# benchmarks/inference/serve-results-gpu.json and results-gpu.json (the infer step's); then
# `python benchmarks/summary.py` renders them into the README's table.
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=${1:?usage: benchmarks/gpu/run.sh WHEEL_FOLDER [STEP...] (bash benchmarks/gpu/wheels.sh makes one)}
shift
all_steps=(workflow tests train train-smollm2 serve infer uccl)
chosen=("${@:-${all_steps[@]}}")
for name in "${chosen[@]}"; do
  [[ " ${all_steps[*]} " == *" $name "* ]] || {
    echo "benchmarks/gpu/run.sh: no step $name (steps: ${all_steps[*]})" >&2
    exit 2
  }
done
out=${OUT:-benchmarks/gpu/out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# kept from call to call on one machine (a fresh machine starts without it)
work=${GPU_WORK:-/tmp/distlm-gpu}
wf="$work/workflow"
mkdir -p "$wf"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee "$out/run.log") 2>&1
started=$(date +%s)
budget=${BUDGET_S:-530}  # the whole run's: the steps share it, the summary comes after
steps=()

# step NAME SECONDS COMMAND...: run it under a time limit (its own, or what is left of the
# budget); its exit code and seconds go to summary.json (124: out of time).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((started + budget - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then
    echo "=== $name: not run: the ${budget} s budget is spent"
    steps+=("{\"step\": \"$name\", \"exit\": null, \"seconds\": 0, \"why\": \"budget spent\"}")
    return 124
  fi
  echo "=== $name (at most ${limit} s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=20 "$limit" "$@"
  rc=$?
  local dt=$(($(date +%s) - t0))
  echo "=== $name: exit $rc after ${dt} s"
  steps+=("$($py -c 'import json, sys; print(json.dumps({"step": sys.argv[1],
    "exit": int(sys.argv[2]), "seconds": int(sys.argv[3]), "command": sys.argv[4:]}))' \
    "$name" "$rc" "$dt" "$@")")
  return $rc
}

# not_run NAME WHY: a step asked for that cannot run, written down with the reason
not_run() {
  echo "=== $1: not run: $2"
  steps+=("$($py -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "exit": None,
    "seconds": 0, "command": [], "why": sys.argv[2]}))' "$1" "$2")")
}

summary() {
  local items
  items=$(IFS=,; echo "${steps[*]-}")
  $py benchmarks/gpu/collect.py summary "$out/summary.json" "[$items]" "$(($(date +%s) - started))"
}
trap summary EXIT

# trained: whether the workflow's run has its trained folder (this call's, or an earlier call's on
# this machine), which the tests, serve and infer read
trained() { [ -f "$wf/results/train/final/model.safetensors" ]; }

# needs_run NAME: step NAME reads the workflow's finished run; without one it is written down as
# not run (and this returns 1)
needs_run() {
  trained || {
    not_run "$1" "no finished workflow run: it reads the workflow's (name the workflow step first)"
    return 1
  }
}

# -- the whole workflow on config/gpu.yaml, then what it wrote, in one file --------------------
run_workflow() {
  if [ -n "$(ls -A "$wf/.snakemake/locks" 2>/dev/null)" ]; then
    # an earlier call's run ended by its time limit: Snakemake's lock is stale
    $py -m snakemake --profile profiles/local --configfile config/gpu.yaml --directory "$wf" --unlock
  fi
  step workflow 210 $py -m snakemake --profile profiles/local --configfile config/gpu.yaml \
    --directory "$wf"
  $py benchmarks/gpu/collect.py workflow "$wf" "$out/workflow-gpu.json"
}

# -- the gpu tests, on the workflow's run ------------------------------------------------------
run_tests() {
  if trained; then
    export DISTLM_TESTS_GPU_WORKFLOW="$wf"  # the tests read this run (without it, they make one)
  fi
  step tests 240 bash -c 'set -o pipefail; "$0" -m pytest -m gpu -p no:cacheprovider -q \
    --basetemp "$1" 2>&1 | tee "$2"' "$py" "$work/pytest-tmp" "$out/pytest-gpu.txt"
  # torch.compile's first step: the workflow's (an empty cache) against the processes of the
  # kill test (the same graphs, from the cache it left: the second is the resumed one)
  echo "=== compile: the first step of each training process (cold, then from the cache)"
  grep -h "the first of this process" "$wf/logs/train/rank0.log" \
    "$work"/pytest-tmp/test_a_killed_training_resume*/work/logs/train/rank0.log 2>/dev/null || true
}

# -- training: the stage beside the nanoGPT-style loop, GPT-2 small's real shape ---------------
run_train() {
  step train 170 $py benchmarks/train/bench_train.py --preset gpt2 --nproc 1 \
    --device cuda --precision bf16 --steps 60 --skip 20 --only distlm nanogpt \
    --set train.ckpt_every=20 --note "benchmarks/gpu/run.sh" --out "$out/train-results-gpu.json"
}

# -- training: the stage alone on SmolLM2-135M's shape (the Llama family) -----------------------
run_train-smollm2() {
  step train-smollm2 200 $py benchmarks/train/bench_train.py \
    --preset smollm2 --nproc 1 --device cuda --precision bf16 --steps 60 --skip 20 --only distlm \
    --set train.ckpt_every=20 --note "benchmarks/gpu/run.sh" \
    --out "$out/train-results-gpu-smollm2.json"
}

# -- serving: distlm against transformers serve on the GPU, on the trained folder --------------
run_serve() {
  needs_run serve || return
  step serve 110 $py benchmarks/inference/bench_serve.py --device cuda \
    --model "$wf/results/train/final" --stages 1 --servers peer,distlm --clients 1,16,64 \
    --repeats 1 --seconds 6 --max-tokens 32 --threads 4 --note "benchmarks/gpu/run.sh" \
    --out "$out/serve-results-gpu.json"
}

# -- batch inference: the pipeline against batched `generate`, on the trained folder -----------
run_infer() {
  needs_run infer || return
  step infer 90 $py benchmarks/inference/bench.py --device cuda \
    --model "$wf/results/train/final" --stages 1 --peers hf_batched --m 32 \
    --max-new-tokens 64 --repeats 2 --batch-only --note "benchmarks/gpu/run.sh" \
    --out "$out/infer-results-gpu.json"
}

# -- the broadcast over UCCL, when its wheel came and there are two GPUs ------------------------
run_uccl() {
  ls "$wheels"/uccl-*.whl >/dev/null 2>&1 || {
    not_run uccl "no uccl wheel in $wheels"
    return
  }
  needs_run uccl || return
  local gpus
  gpus=$($py -c 'import torch; print(torch.cuda.device_count())')
  [ "$gpus" -ge 2 ] || {
    not_run uccl "$gpus GPU(s): UCCL moves GPU memory between two"
    return
  }
  step uccl 90 $py -m snakemake --profile profiles/local --configfile config/gpu.yaml \
    --directory "$wf" --forcerun broadcast results/broadcast/report.json \
    --config 'transfer={"transport": "uccl"}' 'broadcast={"receivers": 1}' &&
    cp "$wf/results/broadcast/report.json" "$out/broadcast-uccl.json"
}

# -- install: the wheels (distlm's dependencies the image lacks) and distlm, offline -----------
step install 120 bash -c "
  $py -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \"$wheels\"/*.whl &&
  $py -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e ." || exit 1
nvidia-smi || true
for name in "${chosen[@]}"; do
  "run_$name"
done
