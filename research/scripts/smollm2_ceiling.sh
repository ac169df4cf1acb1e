#!/usr/bin/env bash
# The ceiling measurement of research/smollm2.md ("the ceiling before scaling the data"):
# features of the first greedy rollouts of scripts/smollm2.sh's mix, a plain and a
# lookup-input drafter trained on them, and the suite with the per-round oracle (--split)
# next to prompt lookup, the hybrid and suffix decoding. First:
#   ROLLOUT_PROMPTS=128 bash scripts/smollm2.sh prompts rollouts
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/blockdraft/smollm2-recipe}
BD=${BD:-.venv/bin/blockdraft}
export BLOCKDRAFT_THREADS=${THREADS:-1}
FEATURES=$OUT/features/L1-8-14-20-27
$BD features --target smollm2-135m --rollouts "$OUT/rollouts/mix-t0" --out "$FEATURES" \
    --layer-ids 1 8 14 20 27 --no-progress
for name in lookup plain; do
  run=$OUT/runs/$name-128
  [ -d "$run/final" ] && continue
  extra=(); [ "$name" = lookup ] && extra=(drafter.lookup_inputs=true)
  $BD train --config configs/smollm2-135m.yaml --overwrite run_dir="$run" \
      logging.progress=false eval.every=0 data.train_rollouts="$OUT/rollouts/mix-t0" \
      data.allow_incomplete=true data.eval_split=0 data.features="$FEATURES" \
      target.layer_ids="[1, 8, 14, 20, 27]" data.max_seq_len=2048 num_anchors=64 \
      optim.max_steps=150 optim.epochs=1000 checkpoint.save_every=50 "${extra[@]}" > "$run.log" 2>&1
done
$BD suite --target smollm2-135m --suite configs/suites/smollm2.yaml --split \
    --rollouts-dir "$OUT/suite-rollouts" --cache-dir "$OUT/cache" --no-progress \
    --json "$OUT/suite-128.json" --overwrite "$OUT/runs/lookup-128" "$OUT/runs/plain-128" \
    "hybrid:$OUT/runs/plain-128" suffix:global=1 | tee "$OUT/suite-128.txt"
