#!/usr/bin/env bash
# One command that checks a GPU machine: installs distlm from a folder of wheels, runs the whole
# workflow on config/gpu.yaml, the `gpu` tests, and the training, serving and batch-inference
# benchmarks on CUDA, and writes what it measured under $OUT. One call of at most 9 minutes:
#
#   bash benchmarks/gpu/wheels.sh .whl          # on a machine with PyPI: the wheels (docs/performance.md, "GPU")
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh .whl             # every step, ~9 min on an H100
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh .whl extra       # optional second call, below
#
# STEPs name the steps to run after the install, in the order given (default: every step of
# one call, in the order below: the figures still missing first, then correctness). A session
# lent a machine has 15 minutes of device time, the machine's start included, and one call runs
# at most 10 minutes. Each step has a time limit, and together they keep to a budget (BUDGET_S,
# 530 s); a step that fails or runs out of time is written down and the next one still runs;
# summary.json lists every step with its exit code and seconds, or why it did not run (the
# budget spent, not asked for, nothing to run it on).
#
# The limits come from the H100 runs of 2026-11-27 at 794d75f (../shared/notes/gpu-h100-
# 2026-11-27.md) and 2026-11-28 at efe8095 (benchmarks/LOG.md), plus a margin; where no run
# measured a step, from what it runs. The steps come in this order: the figures never measured
# since the model's rewrite first (training, then serving), then the correctness steps, which
# have run on an H100 twice already (the 2026-11-28 call spent ~420 s on workflow and tests and cut
# training at its limit); a call reaches as far as its budget, and a second call on the warm
# machine names the steps it did not reach (`run.sh .whl workflow tests`):
#   step            measured   limit   what it runs
#   install         11 s       60 s    the wheels and distlm (always first)
#   train           >150 s     170 s   benchmarks/train/bench_train.py --preset gpt2: the stage
#                                      (2026-11-28: 84 s for 200 steps, compile and start-up in)
#                                      beside the nanoGPT-style loop (25 s compile), 200 steps each
#                                      (~45 ms a step), and one matmul peak; 150 s ended it in the loop
#   train-smollm2   -          130 s   bench_train.py --preset smollm2 --only distlm: the stage on
#                                      SmolLM2-135M's shape (30 blocks: ~2.5x GPT-2's compile), 100 steps
#   train-fsdp      -          150 s   bench_train.py --preset gpt2 --parallel fsdp: the stage under
#                                      train.parallel fsdp beside ddp, GPT-2 small's shape, 100 steps
#                                      each: MFU, rank 0's state and peak memory under each
#   serve           129 s      330 s   benchmarks/inference/bench_serve.py: distlm serve with 1 and
#                                      with 4 API server processes (serve.api_servers) beside
#                                      `transformers serve --continuous-batching`, 16, 64 and 256
#                                      clients, 2 repeats of 10 s a level (129 s was 3 servers,
#                                      2 levels, 1 x 8 s), on the workflow's trained folder, or
#                                      without one on a folder of its own (serve-model: GPT-2
#                                      small's shape, seeded, ~30 s); per level each process's
#                                      CPU and stage 0's wall, host and device (CUDA events) time
#                                      a micro-batch; then serve-profile (60 s): py-spy on the API
#                                      process and stage 0 at 64 clients (profile_serve.py), into
#                                      the same file; then serve-update (60 s): 5 live weight
#                                      updates at 64 clients (bench_update.py), into the same file
#   infer           29 s       80 s    benchmarks/inference/bench.py --batch-only: the one-stage
#                                      pipeline, 32 prompts in flight, beside batched `generate`
#                                      (the same folder as serve)
#   workflow        149 s      190 s   snakemake --profile profiles/local --configfile config/gpu.yaml
#                                      (rule all: 120 steps of GPT-2 small's shape, the evaluations,
#                                      batch inference, the report)
#   tests           >200 s     260 s   pytest -m gpu on the workflow's run (DISTLM_TESTS_GPU_WORKFLOW);
#                                      2026-11-28: its first 4 tests ~100 s, the killed-training test
#                                      ~75 s (it failed at its resumed first step, since mended), 200 s
#                                      ran out in the 6th of 15
#   uccl            -          90 s    the broadcast stage over UCCL, with a uccl wheel and two GPUs
#   extra           -          -       optional second call (not in the default): the training
#                                      comparison with HF Trainer and hf-compile, serving at 1, 16
#                                      and 64 clients with 3 repeats (distlm, and with two steps in
#                                      flight: distlm-overlap), config/llama-1b-fsdp.yaml's
#                                      training on the GPU (~1.0 B parameters under fsdp; its
#                                      training record holds rank 0's peak memory beside what the
#                                      admission check predicted), and the train-fsdp step when the
#                                      first call's budget did not reach it
#
# For a machine with Python 3.12 and a CUDA build of torch already installed and no network (the
# GPU machines lent here: torch 2.11 with CUDA 13): every other package comes from the wheel folder
# (`pip install --no-index --no-deps`), distlm itself as an editable install. The work folder
# (GPU_WORK, /tmp/distlm-gpu) stays from call to call on one machine: a second call's workflow
# step finds the run finished and reruns nothing (what the user's second `snakemake` does), and
# the steps that read its trained folder (tests, serve, infer) use it. torch.compile's caches are
# what a user gets: the stages keep theirs with the run, and each benchmark job starts from empty
# ones, so the one-time costs are a first run's.
#
# Files under $OUT (default benchmarks/gpu/out): summary.json (each step: command, exit code,
# seconds, or why it did not run; the machine and the versions), run.log (everything printed),
# workflow-gpu.json (the workflow's reports: broadcast, evaluation, training record and its
# one-time costs, inference timing, per-rule wall time), train-results-gpu.json,
# serve-results-gpu.json, infer-results-gpu.json, train-results-gpu-smollm2.json,
# train-results-gpu-fsdp.json (8 files: what the device tool brings back from one call, at most;
# the gpu tests' printout is in run.log, and in $GPU_WORK/pytest-gpu.txt on the machine;
# broadcast-uccl.json and extra-*.json come from a second).
# The figures are committed as benchmarks/train/results-gpu.json, results-gpu-smollm2.json,
# results-gpu-fsdp.json,
# benchmarks/inference/serve-results-gpu.json and results-gpu.json (the infer step's); then
# `python benchmarks/summary.py` renders them into the README's table.
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=${1:?usage: benchmarks/gpu/run.sh WHEEL_FOLDER [STEP...] (bash benchmarks/gpu/wheels.sh makes one)}
shift
one_call=(train train-smollm2 train-fsdp serve infer workflow tests uccl)
all_steps=("${one_call[@]}" extra)
chosen=("${@:-${one_call[@]}}")
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
# budget); its exit code, seconds and limit go to summary.json (124: out of time). With DRY_RUN=1
# (tests/test_checks.py, on a machine without a GPU) every step is written down, not run.
dry=${DRY_RUN:-0}
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((started + budget - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then
    not_run "$name" "the ${budget} s budget is spent"
    return 124
  fi
  echo "=== $name (at most ${limit} s): $*"
  local t0 rc=0
  t0=$(date +%s)
  if [ "$dry" = 1 ]; then
    echo "(dry run)"
  else
    timeout --kill-after=20 "$limit" "$@"
    rc=$?
  fi
  local dt=$(($(date +%s) - t0))
  echo "=== $name: exit $rc after ${dt} s"
  steps+=("$($py -c 'import json, sys; print(json.dumps({"step": sys.argv[1],
    "exit": None if sys.argv[5] == "1" else int(sys.argv[2]), "seconds": int(sys.argv[3]),
    "limit": int(sys.argv[4]), "command": sys.argv[6:]}
    | ({"why": "dry run"} if sys.argv[5] == "1" else {})))' \
    "$name" "$rc" "$dt" "$limit" "$dry" "$@")")
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
for name in "${all_steps[@]}"; do  # the steps not asked for, written down as such
  [[ " ${chosen[*]} " == *" $name "* ]] || not_run "$name" "not asked for (steps: ${chosen[*]})"
done

# trained: whether the workflow's run has its trained folder (this call's, or an earlier call's on
# this machine), which the tests, serve and infer read
trained() { [ "$dry" = 1 ] || [ -f "$wf/results/train/final/model.safetensors" ]; }

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
  step workflow 190 $py -m snakemake --profile profiles/local --configfile config/gpu.yaml \
    --directory "$wf"
  [ "$dry" = 1 ] || $py benchmarks/gpu/collect.py workflow "$wf" "$out/workflow-gpu.json"
}

# -- the gpu tests, on the workflow's run ------------------------------------------------------
run_tests() {
  if trained; then
    export DISTLM_TESTS_GPU_WORKFLOW="$wf"  # the tests read this run (without it, they make one)
  fi
  step tests 260 bash -c 'set -o pipefail; "$0" -m pytest -m gpu -p no:cacheprovider -q \
    --basetemp "$1" 2>&1 | tee "$2"' "$py" "$work/pytest-tmp" "$work/pytest-gpu.txt"
  # torch.compile's first step: the workflow's (an empty cache) against the processes of the
  # kill test (the same graphs, from the cache it left: the second is the resumed one)
  echo "=== compile: the first step of each training process (cold, then from the cache)"
  grep -h "the first of this process" "$wf/logs/train/rank0.log" \
    "$work"/pytest-tmp/test_a_killed_training_resume*cuda*/work/logs/train/rank0.log \
    "$work"/pytest-tmp/test_a_killed_training_resume*/work/logs/train/rank0.log 2>/dev/null || true
}

# -- training: the stage beside the nanoGPT-style loop, GPT-2 small's real shape ---------------
# 200 steps, saves at 100 and 200: ~4.5 s apart, wider than a write of GPT-2 small with AdamW
# (the 2026-11-27 run's saves 20 steps apart waited for the previous write: 3.99 and 3.35 s)
run_train() {
  step train 170 $py benchmarks/train/bench_train.py --preset gpt2 --nproc 1 \
    --device cuda --precision bf16 --steps 200 --skip 20 --only distlm nanogpt \
    --set train.ckpt_every=100 --note "benchmarks/gpu/run.sh" --out "$out/train-results-gpu.json"
}

# -- training: the stage alone on SmolLM2-135M's shape (the Llama family) -----------------------
run_train-smollm2() {
  step train-smollm2 130 $py benchmarks/train/bench_train.py \
    --preset smollm2 --nproc 1 --device cuda --precision bf16 --steps 100 --skip 20 --only distlm \
    --set train.ckpt_every=50 --note "benchmarks/gpu/run.sh" \
    --out "$out/train-results-gpu-smollm2.json"
}

# -- training: the stage under fsdp beside ddp, GPT-2 small's shape ---------------------------
run_train-fsdp() {
  step train-fsdp 150 $py benchmarks/train/bench_train.py --preset gpt2 --nproc 1 \
    --device cuda --precision bf16 --steps 100 --skip 20 --parallel fsdp --only distlm \
    --set train.ckpt_every=50 --note "benchmarks/gpu/run.sh" \
    --out "$out/train-results-gpu-fsdp.json"
}

# bench_model: sets `model` to the folder the serving and inference benchmarks read: the
# workflow's trained one (this call's, or an earlier call's on this machine), or, without one, a
# model folder of their own (GPT-2 small's shape from config/gpu.yaml's seeded init: throughput
# needs no training), made once by the user's command for that target (step serve-model)
bench_model() {
  if trained; then
    model="$wf/results/train/final"
    return
  fi
  model="$work/serve/results/model/base"
  [ -f "$model/model.safetensors" ] && return
  step serve-model 60 $py -m snakemake results/model/base --profile profiles/local \
    --configfile config/gpu.yaml --directory "$work/serve"
}

# -- serving: distlm against transformers serve on the GPU ---------------------------------------
run_serve() {
  bench_model || return
  step serve 330 $py benchmarks/inference/bench_serve.py --device cuda \
    --model "$model" --stages 1 --servers peer,distlm --api-servers 1,4 --clients 16,64,256 \
    --repeats 2 --seconds 10 --max-tokens 32 --threads 4 --note "benchmarks/gpu/run.sh" \
    --out "$out/serve-results-gpu.json" || return
  # py-spy on the API server process and stage 0 at 64 clients, into the same file
  step serve-profile 60 $py benchmarks/inference/profile_serve.py --device cuda \
    --model "$model" --clients 64 --seconds 8 --warmup 5 --note "benchmarks/gpu/run.sh" \
    --out "$work/serve-profile-gpu.json" --merge-into "$out/serve-results-gpu.json"
  # #65: live weight updates at 64 clients (5 from disk: the folder and seeded other weights
  # of its shape, each as a model folder and a pipeline folder), what each update took
  step serve-update 60 $py benchmarks/inference/bench_update.py --device cuda \
    --model "$model" --other perturbed --clients 64 --updates 5 --steady-s 5 --between-s 2 \
    --max-tokens 32 --threads 4 --out "$work/update-results-gpu.json" \
    --merge-into "$out/serve-results-gpu.json"
}

# -- batch inference: the pipeline against batched `generate`, on the trained folder -----------
run_infer() {
  bench_model || return
  step infer 80 $py benchmarks/inference/bench.py --device cuda \
    --model "$model" --stages 1 --peers hf_batched --m 32 \
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
  # the target first: after --forcerun (or --configfile) it would be read as one more value
  step uccl 90 $py -m snakemake results/broadcast/report.json --profile profiles/local \
    --configfile config/gpu.yaml --directory "$wf" --forcerun broadcast \
    --config 'transfer={"transport": "uccl"}' 'broadcast={"receivers": 1}' &&
    cp "$wf/results/broadcast/report.json" "$out/broadcast-uccl.json"
}

# -- the optional second call: the longer comparisons ------------------------------------------
run_extra() {
  step extra-train 300 $py benchmarks/train/bench_train.py --preset gpt2 --nproc 1 \
    --device cuda --precision bf16 --steps 200 --skip 20 --only distlm nanogpt hf hf-compile \
    --set train.ckpt_every=100 --note "benchmarks/gpu/run.sh extra" \
    --out "$out/extra-train-results-gpu.json"
  [ -f "$out/train-results-gpu-fsdp.json" ] || run_train-fsdp
  # config/llama-1b-fsdp.yaml as a user runs it, in a folder of its own: ~1.0 B parameters from a
  # seeded init, fsdp over the node's GPUs (one here), through the trained folder
  local big="$work/llama-1b-fsdp"
  mkdir -p "$big"
  step extra-llama-1b-fsdp 300 $py -m snakemake results/train/final --profile profiles/local \
    --configfile config/llama-1b-fsdp.yaml --directory "$big" &&
    cp "$big/results/train/final/distlm.json" "$out/extra-llama-1b-fsdp-distlm.json"
  needs_run extra-serve || return
  step extra-serve 240 $py benchmarks/inference/bench_serve.py --device cuda \
    --model "$wf/results/train/final" --stages 1 --servers peer,distlm,distlm-overlap --clients 1,16,64 \
    --repeats 3 --seconds 10 --max-tokens 32 --threads 4 --note "benchmarks/gpu/run.sh extra" \
    --out "$out/extra-serve-results-gpu.json"
}

# -- install: the wheels (distlm's dependencies the image lacks) and distlm, offline -----------
step install 60 bash -c "
  $py -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \"$wheels\"/*.whl &&
  $py -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e ." || exit 1
[ "$dry" = 1 ] || nvidia-smi || true
for name in "${chosen[@]}"; do
  "run_$name"
done
