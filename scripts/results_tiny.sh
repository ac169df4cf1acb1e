#!/usr/bin/env bash
# Exact commands behind the `tiny` sections of docs/results.md, in the order they were run.
# Run from the repo root. One process at a time, one thread each (shared 2-core machine).
# Run dirs and JSON go OUTSIDE the repo (/work/results_runs/tiny); only PNGs are copied to docs/results/.
set -euo pipefail
export OMP_NUM_THREADS=1
BD=.venv/bin/blockdraft
DEMO=/tmp/demo_tiny                     # greedy demo (step 0)
OUT=/work/results_runs/tiny
mkdir -p "$OUT/runs" "$OUT/json" "$OUT/report"

# 0. Greedy (T=0) demo with default settings: rollouts (384 train / 64 eval stdlib prompts,
#    128 new tokens), decay + dpace from scratch (block 8), e2e + edr fine-tunes of dpace
#    (1 epoch, lr 3e-4), offline eval/compare, online decoding (8 prompts, 96 tokens).
[ -f "$DEMO/report.json" ] || $BD demo --epochs 3 --finetune-epochs 1 --temperature 0 --out "$DEMO"

# The demo's exact training config (what demo.py `_train_config` resolves to; identical to
# $DEMO/runs/dpace/run.yaml minus the `provenance:` block, which `train --config` rejects).
CFG="$OUT/demo_train_config.yaml"
sed '/^provenance:/,/^[^ ]/{/^provenance:/d;/^  /d}' "$DEMO/runs/dpace/run.yaml" > "$CFG"

train() {  # train NAME key=value...  (same data/budget/seed as the demo; only the given keys change)
  local name=$1; shift
  [ -d "$OUT/runs/$name/final" ] || $BD train --config "$CFG" run_dir="$OUT/runs/$name" "$@"
}

# 1. D-PACE variants and alpha = 0 at block 8 (full / alpha 0.5 = the demo's dpace run)
train dpace-cumulative   objective.name=dpace objective.variant=cumulative
train dpace-continuation objective.name=dpace objective.variant=continuation
train dpace-a0.0         objective.name=dpace objective.alpha=0.0

# Offline evaluation on the demo's 64 held-out greedy rollouts (exact MAL, AR_k; paired bootstrap CIs)
EVAL="--target tiny --rollouts $DEMO/rollouts/eval/set --cache-dir $OUT/cache --no-progress"
$BD compare $EVAL --json "$OUT/json/compare_b8_variants.json" \
    "$DEMO/runs/decay" "$DEMO/runs/dpace" "$OUT/runs/dpace-cumulative" "$OUT/runs/dpace-continuation" "$OUT/runs/dpace-a0.0"
$BD eval $EVAL --json "$OUT/json/eval_b8_variants.json" \
    "$DEMO/runs/decay" "$DEMO/runs/dpace" "$OUT/runs/dpace-cumulative" "$OUT/runs/dpace-continuation" "$OUT/runs/dpace-a0.0"

# 2. Sampling mode: the same demo at T=1 (its own T=1 rollouts; decay/dpace/e2e/edr; online tau, speedup)
T1=/work/results_runs/tiny-t1
[ -f "$T1/report.json" ] || $BD demo --epochs 3 --finetune-epochs 1 --temperature 1.0 --out "$T1"

# 3. Online tau vs offline MAL on exactly the same prompts and settings (first 16 held-out
#    rollouts, 128 new tokens), with wall-clock speedup vs autoregressive decoding
for r in decay dpace; do
  $BD decode --target tiny --drafter "$DEMO/runs/$r" --rollouts "$DEMO/rollouts/eval/set" --limit 16 \
      --seed 0 --no-progress --json "$OUT/json/decode_t0_$r.json"
done
for r in decay edr; do
  $BD decode --target tiny --drafter "$T1/runs/$r" --rollouts "$T1/rollouts/eval/set" --limit 16 \
      --seed 0 --no-progress --json "$OUT/json/decode_t1_$r.json"
done

# 4. Seed replicate of the headline pair (decay vs D-PACE full, block 8): everything as the
#    demo except seed=1 (drafter init, data order, anchors)
train decay-seed1 objective.name=decay seed=1
train dpace-seed1 objective.name=dpace seed=1
$BD compare $EVAL --json "$OUT/json/compare_b8_seed1.json" "$OUT/runs/decay-seed1" "$OUT/runs/dpace-seed1"

# 5. Plots for block 8 (training curves with eval MAL, AR_k, D-PACE weight profiles)
# (run dirs go BEFORE --eval/--compare: those options take any number of files)
$BD report "$DEMO/runs/decay" "$DEMO/runs/dpace" "$OUT/runs/dpace-cumulative" "$OUT/runs/dpace-continuation" "$OUT/runs/dpace-a0.0" \
    --out "$OUT/report/b8_variants" --title "tiny, block 8: decay vs D-PACE variants (T=0)" \
    --eval "$OUT/json/eval_b8_variants.json" --compare "$OUT/json/compare_b8_variants.json"

# 6. alpha sweep at block 8 (0.5 = the demo's dpace, 0.0 above)
train dpace-a0.3 objective.name=dpace objective.alpha=0.3
train dpace-a0.7 objective.name=dpace objective.alpha=0.7
$BD compare $EVAL --json "$OUT/json/compare_b8_alpha.json" \
    "$DEMO/runs/decay" "$OUT/runs/dpace-a0.0" "$OUT/runs/dpace-a0.3" "$DEMO/runs/dpace" "$OUT/runs/dpace-a0.7"
$BD eval $EVAL --json "$OUT/json/eval_b8_alpha.json" \
    "$DEMO/runs/decay" "$OUT/runs/dpace-a0.0" "$OUT/runs/dpace-a0.3" "$DEMO/runs/dpace" "$OUT/runs/dpace-a0.7"

# 7. Second seed replicate of the headline pair (seed=2)
train decay-seed2 objective.name=decay seed=2
train dpace-seed2 objective.name=dpace seed=2
$BD compare $EVAL --json "$OUT/json/compare_b8_seed2.json" "$OUT/runs/decay-seed2" "$OUT/runs/dpace-seed2"
