#!/usr/bin/env bash
# EDR's fine-tune cost on `tiny` at T = 0.7 / top-p 0.8 / top-k 20 with and without the
# target's distributions stored in the rollouts (research/results.md, section 6, session 32):
# 8 training rollouts written twice (the same tokens: the sampler is counter-based), once
# with `--store-topk 0` (the step processes the target's logits) and once with the
# default (the top 20 stored), their cached features, then the cost bench on the stored
# set with the logits set's E2E and EDR @16 rows in the same rounds, and on cached
# features, RUNS times. Needs the T = 0.7 start of `SETTINGS=t07 SEEDS=0
# research/scripts/edr_finetune.sh rollouts base` (DRAFTER). Output under $OUT (ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-results_runs/edr-cost-stored}
BD=${BD:-.venv/bin/blockdraft}
PY=${PY:-.venv/bin/python}
DRAFTER=${DRAFTER:-results_runs/edr/runs/base-t07-s0/final}
flags=(--target tiny --prompts stdlib:train --limit 8 --temperature 0.7 --top-p 0.8 --top-k 20
  --max-new-tokens 128 --seed 0 --no-progress)
grep -qs '"complete": true' "$O/logits/manifest.json" || $BD rollout "${flags[@]}" --store-topk 0 --out "$O/logits"
grep -qs '"complete": true' "$O/stored/manifest.json" || $BD rollout "${flags[@]}" --out "$O/stored"
grep -qs '"complete": true' "$O/features/manifest.json" ||
  $BD features --target tiny --layer-ids 0 1 2 3 --rollouts "$O/stored" --out "$O/features"
bench() { $PY bench/edr_finetune_cost.py --drafter "$DRAFTER" --threads 1 --rounds "${ROUNDS:-7}" "$@"; }
for i in $(seq 1 "${RUNS:-2}"); do
  echo "== run $i: stored distributions, and E2E / EDR @16 from the target's logits side by side"
  bench --rollouts "$O/stored" --also-rollouts "$O/logits"
  echo "== run $i: stored distributions and cached features"
  bench --rollouts "$O/stored" --features "$O/features"
done
