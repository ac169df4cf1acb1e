#!/usr/bin/env bash
# Exact commands behind the `tiny` sections of research/results.md (run from the repo root).
# Sections are in priority order; each is idempotent (finished runs are skipped), so the
# script can be re-run after an interruption. Run dirs and JSON go OUTSIDE the repo
# ($OUT); only the PNGs are copied to research/. One thread per process: the runs
# shared 2 cores with the Gemma job (research/scripts/gemma_gsm8k.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
BD=.venv/bin/blockdraft
OUT=${OUT:-results_runs/tiny2}       # ignored by git
T1=$OUT/demo-t1          # sampling (T=1), the demo's default temperature
T0=$OUT/demo-t0          # greedy (T=0)
mkdir -p "$OUT/runs" "$OUT/json" "$OUT/report"
SECTIONS=${*:-"t1 ablations blocks finetune-lr t0 decode seeds-t1 seeds-t0 report"}

# The demo's exact training config for a demo dir (its dpace run.yaml minus the
# `provenance:` block, which `train --config` rejects).
config_of() { sed '/^provenance:/,/^[^ ]/{/^provenance:/d;/^  /d}' "$1/runs/dpace/run.yaml"; }

train() {  # train DEMO_DIR NAME key=value...: the demo's data/budget/seed; only the given keys change
  local demo=$1 name=$2; shift 2
  [ -d "$OUT/runs/$name/final" ] && return 0
  config_of "$demo" > "$OUT/$(basename "$demo")_config.yaml"
  $BD train --config "$OUT/$(basename "$demo")_config.yaml" run_dir="$OUT/runs/$name" \
      logging.progress=false "$@"
}
finetune() {  # finetune NAME OBJECTIVE LR: one epoch from the T=1 demo's D-PACE drafter
  train "$T1" "$1" objective.name="$2" drafter.init_from="$T1/runs/dpace/final" \
      optim.epochs=1 optim.lr="$3" optim.warmup_ratio=0.0
}
compare() {  # compare DEMO_DIR NAME RUN...: paired comparisons (consecutive pairs) + per-drafter eval
  local demo=$1 name=$2; shift 2
  local ev="--target tiny --rollouts $demo/rollouts/eval/set --cache-dir $OUT/cache --no-progress"
  $BD compare $ev --json "$OUT/json/compare_$name.json" "$@"
  $BD eval $ev --json "$OUT/json/eval_$name.json" "$@"
}
R=$OUT/runs

for section in $SECTIONS; do case $section in
t1)  # 1. The demo at T=1 with a 3-epoch budget: decay & D-PACE (full, alpha 0.5) from
     #    scratch, E2E & EDR fine-tunes of D-PACE (1 epoch, lr 3e-4), offline + online eval.
  [ -f "$T1/report.json" ] || $BD demo --epochs 3 --finetune-epochs 1 --out "$T1" ;;
ablations)  # 2. D-PACE variants and alpha at block 8 (same data, budget, seed as the demo)
  train "$T1" cumulative   objective.name=dpace objective.variant=cumulative
  train "$T1" continuation objective.name=dpace objective.variant=continuation
  for a in 0.0 0.3 0.7; do train "$T1" "alpha$a" objective.name=dpace objective.alpha=$a; done
  compare "$T1" variants "$T1/runs/decay" "$T1/runs/dpace" "$R/cumulative" "$R/continuation"
  compare "$T1" alpha "$T1/runs/decay" "$R/alpha0.0" "$R/alpha0.3" "$T1/runs/dpace" "$R/alpha0.7" ;;
blocks)  # 3. Block sizes 12 and 16 (decay gamma: DFlash's default for the block size, interpolated at 12)
  for b in 12 16; do
    train "$T1" "decay-b$b" objective.name=decay drafter.block_size=$b
    train "$T1" "dpace-b$b" objective.name=dpace drafter.block_size=$b
    compare "$T1" "b$b" "$R/decay-b$b" "$R/dpace-b$b"
  done ;;
finetune-lr)  # 4. EDR vs E2E at the papers' fine-tuning setting (1 epoch, lr 3e-5)
  finetune e2e-lr3e-5 e2e 3e-5
  finetune edr-lr3e-5 edr 3e-5
  compare "$T1" finetune-lr3e-5 "$T1/runs/dpace" "$R/e2e-lr3e-5" "$R/edr-lr3e-5"
  $BD compare --target tiny --rollouts "$T1/rollouts/eval/set" --cache-dir "$OUT/cache" --no-progress \
      --json "$OUT/json/compare_edr-vs-e2e-lr3e-5.json" "$R/e2e-lr3e-5" "$R/edr-lr3e-5" ;;
t0)  # 5. The same demo, greedy (T=0)
  [ -f "$T0/report.json" ] || $BD demo --epochs 3 --finetune-epochs 1 --temperature 0 --out "$T0" ;;
decode)  # 6. Online tau vs offline MAL on the same 16 held-out prompts; speedup at T=0 and T=1
  for t in 0 1; do
    demo=$OUT/demo-t$t
    for r in decay dpace edr; do
      [ -f "$OUT/json/decode_t${t}_$r.json" ] || $BD decode --target tiny --drafter "$demo/runs/$r" \
          --rollouts "$demo/rollouts/eval/set" --limit 16 --seed 0 --no-progress \
          --json "$OUT/json/decode_t${t}_$r.json"
    done
  done ;;
seeds-t1)  # 7. Seed replicates at T=1 (drafter init, data order, anchors): seed 1
  for s in 1; do
    train "$T1" "decay-s$s" objective.name=decay seed=$s
    train "$T1" "dpace-s$s" objective.name=dpace seed=$s
    train "$T1" "cumulative-s$s" objective.name=dpace objective.variant=cumulative seed=$s
    train "$T1" "continuation-s$s" objective.name=dpace objective.variant=continuation seed=$s
    train "$T1" "alpha0.0-s$s" objective.name=dpace objective.alpha=0.0 seed=$s
    compare "$T1" "seed$s" "$R/decay-s$s" "$R/dpace-s$s" "$R/cumulative-s$s" "$R/continuation-s$s" "$R/alpha0.0-s$s"
  done ;;
seeds-t0)  # 8. Seed replicates of the T=0 headline pair
  for s in 1 2; do
    train "$T0" "t0-decay-s$s" objective.name=decay seed=$s
    train "$T0" "t0-dpace-s$s" objective.name=dpace seed=$s
    compare "$T0" "t0-seed$s" "$R/t0-decay-s$s" "$R/t0-dpace-s$s"
  done ;;
report)  # 9. Plots (training curves with held-out MAL, AR_k, D-PACE weight profiles) -> research/
  $BD report "$T1/runs/decay" "$T1/runs/dpace" "$R/cumulative" "$R/continuation" "$R/alpha0.0" \
      --out "$OUT/report/variants" --title "tiny, block 8, T=1: decay vs D-PACE variants" \
      --eval "$OUT/json/eval_variants.json" --compare "$OUT/json/compare_variants.json"
  for f in training_curves acceptance_rates dpace_weight_profile; do
    cp "$OUT/report/variants/$f.png" "research/tiny_t1_variants_$f.png"
  done
  for t in 0 1; do
    for f in training_curves acceptance_rates; do
      cp "$OUT/demo-t$t/report/$f.png" "research/tiny_t${t}_demo_$f.png"
    done
  done ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
