#!/usr/bin/env bash
# The recipe study behind research/results.md "Beating prompt lookup" (run from the repo root):
# why trained `tiny` drafters stalled below the n-gram baseline, and what fixes it.
# Every section is idempotent (finished runs are skipped); run dirs and JSON go OUTSIDE
# the repo ($OUT). Held-out MAL curves come from each run's metrics.jsonl (eval every
# 100 steps on the first 32 held-out rollouts); the final tables are `blockdraft compare`
# on all 64 held-out rollouts with `ngram` as the first (baseline) drafter.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
BD=.venv/bin/blockdraft
OUT=${OUT:-results_runs/recipe}       # ignored by git
mkdir -p "$OUT/runs" "$OUT/json"
SECTIONS=${*:-"rollouts layers depth lr anchors data long long-compare t1 t1-compare blocks hybrid samplers report"}
R=$OUT/runs

rollouts() {  # rollouts NAME PROMPTS LIMIT TEMPERATURE
  [ -f "$OUT/rollouts/$1/manifest.json" ] && grep -q '"complete": true' "$OUT/rollouts/$1/manifest.json" && return 0
  $BD rollout --target tiny --prompts "$2" --limit "$3" --temperature "$4" \
      --max-new-tokens 128 --out "$OUT/rollouts/$1" --no-progress
}

# The base recipe under study: the demo's drafter (1 layer, block 8) and data (T=0).
train() {  # train NAME key=value...: only the given keys change
  local name=$1; shift
  [ -d "$R/$name/final" ] && return 0
  $BD train --config configs/tiny.yaml run_dir="$R/$name" logging.progress=false \
      data.train_rollouts="$OUT/rollouts/train-t0" data.eval_rollouts="$OUT/rollouts/eval-t0" \
      data.eval_split=0 num_anchors=64 optim.batch_size=8 optim.lr=1e-3 \
      eval.every=100 eval.max_rollouts=32 checkpoint.save_every=0 logging.every=20 \
      optim.max_steps=400 "$@"
}
compare() {  # compare NAME EVALSET RUN...: ngram first, then every run
  local name=$1 set=$2; shift 2
  local ev="--target tiny --rollouts $OUT/rollouts/$set --cache-dir $OUT/cache --no-progress"
  $BD compare $ev --json "$OUT/json/compare_$name.json" ngram "$@"
  $BD eval $ev --json "$OUT/json/eval_$name.json" ngram "$@"
}

for section in $SECTIONS; do case $section in
rollouts)  # greedy and sampled (T=1) train/eval sets, 128 new tokens
  rollouts train-t0 stdlib:train 384 0
  rollouts eval-t0 stdlib:eval 64 0
  rollouts train-t1 stdlib:train 384 1
  rollouts eval-t1 stdlib:eval 64 1
  rollouts train-t0-1536 stdlib:train 1536 0 ;;
layers)  # which target layers feed the drafter (tiny has 4; the DFlash default picks [1, 2])
  train layers12
  train layers0123 'target.layer_ids=[0,1,2,3]'
  train layers23 'target.layer_ids=[2,3]'
  train layers3 'target.layer_ids=[3]' ;;
depth)  # drafter depth at the best layer set
  train depth2 'target.layer_ids=[0,1,2,3]' drafter.num_layers=2 ;;
lr)
  train lr3e-3 'target.layer_ids=[0,1,2,3]' optim.lr=3e-3 ;;
anchors)  # more blocks per target forward
  train anchors256 'target.layer_ids=[0,1,2,3]' num_anchors=256 ;;
data)  # 4x the rollouts, same steps
  train data1536 'target.layer_ids=[0,1,2,3]' data.train_rollouts="$OUT/rollouts/train-t0-1536" ;;
long)  # the chosen recipe to convergence (learning curve), decay vs D-PACE, 2 seeds
  for s in ${SEEDS:-0 1}; do
    for obj in decay dpace; do
      train "long-$obj-s$s" objective.name=$obj seed=$s optim.max_steps=${LONG_STEPS:-1500} ${RECIPE:-}
    done
  done
  ;;
long-compare)
  compare long-t0 eval-t0 "$R/long-decay-s0" "$R/long-dpace-s0" "$R/long-decay-s1" "$R/long-dpace-s1" ;;
t1)  # the same recipe at T = 1 (sampled rollouts; D-PACE vs decay)
  for obj in ${OBJS:-decay dpace}; do
    train "t1-$obj" objective.name=$obj optim.max_steps=${T1_STEPS:-800} ${RECIPE:-} \
        data.train_rollouts="$OUT/rollouts/train-t1" data.eval_rollouts="$OUT/rollouts/eval-t1"
  done ;;
t1-compare)
  compare t1 eval-t1 "$R/t1-decay" "$R/t1-dpace" ;;
blocks)  # block 16 (K = 15) at the lr-3e-3 setting; compared with ngram at K = 15
  train block16 'target.layer_ids=[0,1,2,3]' optim.lr=3e-3 drafter.block_size=16 ;;
hybrid)  # the long drafters with prompt lookup as per-slot fallback (drafters/hybrid.py)
  compare hybrid-t0 eval-t0 "$R/long-dpace-s0" "hybrid:$R/long-dpace-s0" "hybrid:$R/long-decay-s0" ;;
samplers)  # EDR round-start samplers: step time, gradient noise, PPS sizes (docs/training.md)
  for m in 32 86; do
    .venv/bin/python research/bench/edr_sampler.py --drafter "$R/long-dpace-s0/final" \
        --rollouts "$OUT/rollouts/train-t0" --max-anchors $m
    .venv/bin/python research/bench/edr_sampler.py --drafter "$R/t1-dpace/final" \
        --rollouts "$OUT/rollouts/train-t1" --max-anchors $m
  done 2>/dev/null | tee "$OUT/json/edr_samplers.txt"
  for run in long-dpace-s0:train-t0 t1-dpace:train-t1; do
    .venv/bin/python research/bench/edr_sampler_sizes.py --drafter "$R/${run%%:*}/final" \
        --rollouts "$OUT/rollouts/${run##*:}" --max-anchors 32
  done 2>/dev/null | tee "$OUT/json/edr_sampler_sizes.txt" ;;
report)  # held-out MAL vs steps of every run, as a table
  .venv/bin/python scripts/curves.py "$R"/* > "$OUT/json/curves.md"; cat "$OUT/json/curves.md" ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
