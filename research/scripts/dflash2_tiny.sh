#!/usr/bin/env bash
# DFlash2 vs DFlash on `tiny` at T = 0, equal budget and (nearly) equal parameters
# (research/results.md "DFlash2 on tiny"): D-PACE, the recipe of research/results.md section 1
# (block 8, 64 anchors, batch 8, lr 3e-3, feature layers 0-3) for STEPS steps, one seed.
#   dflash-1L   DFlash, 1 layer                      262,720 parameters
#   dflash-2L   DFlash, 2 layers                     459,648
#   dflash2-1L  DFlash2, 1 layer, selector rank 22   454,976 (top-16 candidates)
# then `blockdraft compare` on the 64 held-out greedy rollouts, prompt lookup first.
# Run from the repo root; everything goes to $OUT (git-ignored). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
BD=${BD:-env PYTHONPATH=$PWD/src /work/main/.venv/bin/python -m blockdraft}  # this checkout
OUT=${OUT:-results_runs/dflash2/tiny}
STEPS=${STEPS:-400}
mkdir -p "$OUT/runs" "$OUT/json"

rollouts() {  # rollouts NAME PROMPTS LIMIT
  [ -f "$OUT/rollouts/$1/manifest.json" ] && grep -q '"complete": true' "$OUT/rollouts/$1/manifest.json" && return 0
  $BD rollout --target tiny --prompts "$2" --limit "$3" --temperature 0 \
      --max-new-tokens 128 --out "$OUT/rollouts/$1" --no-progress
}
train() {  # train NAME key=value...
  local name=$1; shift
  [ -d "$OUT/runs/$name/final" ] && return 0
  local again=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$OUT/runs/$name/checkpoints/step-*" > /dev/null; then again=--resume
  elif [ -d "$OUT/runs/$name" ]; then again=--overwrite; fi
  $BD train --config configs/tiny.yaml $again run_dir="$OUT/runs/$name" logging.progress=false \
      data.train_rollouts="$OUT/rollouts/train-t0" data.eval_rollouts="$OUT/rollouts/eval-t0" \
      data.eval_split=0 num_anchors=64 optim.batch_size=8 optim.lr=3e-3 \
      'target.layer_ids=[0,1,2,3]' objective.name=dpace \
      eval.every=100 eval.max_rollouts=32 checkpoint.save_every=0 logging.every=20 \
      optim.max_steps="$STEPS" "$@"
}

rollouts train-t0 stdlib:train 384
rollouts eval-t0 stdlib:eval 64
train dflash-1L drafter.num_layers=1
train dflash-2L drafter.num_layers=2
train dflash2-1L drafter.arch=dflash2 drafter.num_layers=1 drafter.selector_rank=22 \
    drafter.selector_top_k=16
$BD compare --target tiny --rollouts "$OUT/rollouts/eval-t0" --cache-dir "$OUT/cache" \
    --no-progress --json "$OUT/json/compare.json" \
    ngram "$OUT/runs/dflash-1L" "$OUT/runs/dflash-2L" "$OUT/runs/dflash2-1L"
