#!/usr/bin/env bash
# A small Gemma set for the EDR fine-tune's cost (issue #31; docs/training.md, "Fewer passes
# over the scoring pass's rows"): 8 GSM8K training rollouts at T = 0.7 / top-p 0.8 / top-k 20
# that store their top-20 distributions, their cached features, and two drafters trained 2
# steps (a plain 2-layer DFlash and the config's DFlash2: the cost does not need trained
# weights), then the cost bench on each from the cached features. SETTINGS=t1: at T = 1
# without cutoffs, where nothing can be stored, so the bench runs the target's LM head (the
# online target) on every row. BENCH_ARGS adds flags (e.g. --tensor-sums). Resumable;
# output under $OUT (ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
SETTINGS=${SETTINGS:-t07}
case $SETTINGS in
  t07) SAMPLING="--temperature 0.7 --top-p 0.8 --top-k 20 --store-topk 20"; SUFFIX="" ;;
  t1) SAMPLING="--temperature 1"; SUFFIX="-t1" ;;  # features hold no logits: online target
  *) echo "SETTINGS must be t07 or t1, got $SETTINGS" >&2; exit 2 ;;
esac
O=${OUT:-results_runs/edr-cost-gemma$SUFFIX}
FEATURES=(--features "$O/features")
[ "$SETTINGS" = t1 ] && FEATURES=()
BD=${BD:-.venv/bin/blockdraft}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
grep -qs '"complete": true' "$O/rollouts/manifest.json" ||
  # shellcheck disable=SC2086  # SAMPLING is a list of flags
  $BD rollout --target gemma-3-270m --prompts ../shared/data/gsm8k/train.jsonl:question \
    --limit 8 $SAMPLING --max-new-tokens 128 --out "$O/rollouts" --no-progress
grep -qs '"complete": true' "$O/features/manifest.json" ||
  $BD features --target gemma-3-270m --layer-ids 1 5 9 13 17 --rollouts "$O/rollouts" \
    --out "$O/features"
for arch in ${ARCHS:-dflash2 dflash}; do
  [ -d "$O/runs/$arch/final" ] ||
    $BD train --config configs/gemma-3-270m.yaml run_dir="$O/runs/$arch" drafter.arch=$arch \
      drafter.num_layers=2 data.train_rollouts="$O/rollouts" data.features="$O/features" \
      data.eval_rollouts=null data.eval_split=0 optim.max_steps=2 optim.batch_size=8 \
      eval.every=0 eval.at_start=false checkpoint.save_every=0 logging.progress=false
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  $PY bench/edr_finetune_cost.py --target gemma-3-270m --drafter "$O/runs/$arch/final" \
    --rollouts "$O/rollouts" "${FEATURES[@]}" --anchors 32 \
    --threads "${THREADS:-2}" --rounds "${ROUNDS:-3}" ${BENCH_ARGS:-}
done
