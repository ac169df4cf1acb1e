#!/usr/bin/env bash
# "EDR as in the paper" on `tiny` (research/results.md, issue #31): fine-tune a D-PACE drafter
# trained to its plateau for one epoch, from the same checkpoint with the same data order
# and step count, with (a) continued D-PACE (the control), (b) E2E, (c) EDR; then exact
# offline MAL on held-out rollouts at the same sampling settings, paired against the
# start and the control. Every run is skipped when its final/ exists (resumable).
# Prompt sets (all disjoint): train = the first 384 stdlib:train prompts, test = the
# first 64 stdlib:eval prompts, val (lr sweeps) = stdlib:eval prompts 65..128.
# Settings: t1 (T = 1), t07 (T = 0.7, top-p 0.8, top-k 20: the paper's other setting),
# t0 (greedy). Sections: rollouts base sweep finetune compare (default: all), and the
# T = 0 studies greedy greedy-fix budget relax;
# SETTINGS="t1 t07 t0", SEEDS="0 1". Output: $OUT (default results_runs/edr, ignored).
# DRAFTER: overrides for every run's drafter, e.g. the DFlash2 protocol (issue #32):
#   OUT=results_runs/edr-dflash2 DRAFTER="drafter.arch=dflash2 drafter.selector_rank=22" ...
# budget: BUDGETS (round starts drafted with gradient; default 32), SAMPLERS (default
#   "gradient uniform"), TAG (a suffix for its json tables, so a later sweep keeps the last).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
BD=${BD:-.venv/bin/blockdraft}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results_runs/edr}
R=$OUT/runs
mkdir -p "$R" "$OUT/json" "$OUT/prompts"
SECTIONS=${SECTIONS:-${*:-rollouts base sweep finetune compare}}
SETTINGS=${SETTINGS:-t1 t07 t0}
SEEDS=${SEEDS:-0 1}
BASE_STEPS=${BASE_STEPS:-500}     # D-PACE from scratch at T > 0 (lr 3e-3, cosine to 0)
SWEEP_LRS=${SWEEP_LRS:-3e-5 3e-4}
PAPER_LR=3e-5
DRAFTER=${DRAFTER:-}

sampling() {  # rollout flags of a setting
  case $1 in
  t1) echo "--temperature 1" ;;
  t07) echo "--temperature 0.7 --top-p 0.8 --top-k 20" ;;  # stores its top 20 (the default)
  t0) echo "--temperature 0" ;;
  *) echo "unknown setting $1" >&2; exit 2 ;;
  esac
}
rollouts() {  # rollouts NAME PROMPTS LIMIT SETTING
  [ -f "$OUT/rollouts/$1/manifest.json" ] && grep -q '"complete": true' "$OUT/rollouts/$1/manifest.json" && return 0
  # shellcheck disable=SC2046
  $BD rollout --target tiny --prompts "$2" --limit "$3" $(sampling "$4") \
      --max-new-tokens 128 --out "$OUT/rollouts/$1" --no-progress
}
train() {  # train NAME SETTING key=value...: the recipe of research/results.md section 1
  local name=$1 set=$2; shift 2
  [ -d "$R/$name/final" ] && return 0
  local again=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$R/$name/checkpoints/step-*" > /dev/null; then again=--resume
  elif [ -d "$R/$name" ]; then again=--overwrite; fi
  $BD train --config configs/tiny.yaml $again run_dir="$R/$name" logging.progress=false \
      data.train_rollouts="$OUT/rollouts/train-$set" data.eval_rollouts="$OUT/rollouts/val-$set" \
      data.eval_split=0 num_anchors=64 optim.batch_size=8 optim.lr=3e-3 \
      'target.layer_ids=[0,1,2,3]' eval.every=0 eval.max_rollouts=64 eval.at_start=false \
      checkpoint.save_every=0 logging.every=4 $DRAFTER "$@"
}
finetune() {  # finetune NAME SETTING SEED OBJECTIVE LR [key=value...]: one epoch from the base
  local name=$1 set=$2 seed=$3 obj=$4 lr=$5; shift 5
  train "$name" "$set" seed="$seed" drafter.init_from="$R/base-$set-s$seed/final" \
      objective.name="$obj" optim.lr="$lr" optim.warmup_ratio=0 optim.schedule=constant \
      optim.epochs=1 "$@"
}
mal() {  # mal SET RUN...: held-out MAL JSON of each run on rollouts SET (for the sweeps)
  local set=$1; shift
  $BD eval --target tiny --rollouts "$OUT/rollouts/$set" --cache-dir "$OUT/cache" --no-progress \
      --json "$OUT/json/eval_$set.$(basename "$1").json" "$@" >/dev/null
}
best_lr() {  # best_lr SETTING SEED OBJECTIVE: the sweep's lr with the highest validation MAL
  $PY - "$OUT/json" "$1" "$2" "$3" $SWEEP_LRS <<'PY'
import json, sys
from pathlib import Path
d, s, seed, obj, *lrs = sys.argv[1:]
scores = {}
for lr in lrs:
    f = Path(d) / f"eval_val-{s}.ft-{s}-s{seed}-{obj}-{lr}.json"
    scores[lr] = json.loads(f.read_text())["benchmarks"][0]["drafters"][0]["mal"]
print(max(scores, key=scores.get))
PY
}

for section in $SECTIONS; do case $section in
rollouts)
  $PY -c "
import json, sys
from blockdraft.data.prompt_specs import load_prompts
with open(sys.argv[1], 'w') as f:
    for p in load_prompts('stdlib:eval', limit=128)[64:]:
        f.write(json.dumps({'id': p.id, 'text': p.text}) + '\n')" "$OUT/prompts/val.jsonl"
  for s in $SETTINGS; do
    rollouts "train-$s" stdlib:train 384 "$s"
    rollouts "test-$s" stdlib:eval 64 "$s"
    rollouts "val-$s" "$OUT/prompts/val.jsonl" 64 "$s"
  done ;;
base)  # D-PACE from scratch to its plateau: the start of every fine-tune
  for s in $SETTINGS; do for seed in $SEEDS; do
    steps=$BASE_STEPS; [ "$s" = t0 ] && steps=${BASE_STEPS_T0:-576}  # t0: the demo's budget
    train "base-$s-s$seed" "$s" seed="$seed" optim.max_steps="$steps" \
        checkpoint.save_every=$((steps / 4)) checkpoint.keep_last=4  # step-N/2: a weaker start
  done; done ;;
sweep)  # seed 0: every objective at every lr; validation MAL picks the lr
  for s in $SETTINGS; do for obj in dpace e2e edr; do for lr in $SWEEP_LRS; do
    finetune "ft-$s-s0-$obj-$lr" "$s" 0 "$obj" "$lr"
    [ -f "$OUT/json/eval_val-$s.ft-$s-s0-$obj-$lr.json" ] || mal "val-$s" "$R/ft-$s-s0-$obj-$lr"
  done; done; done ;;
finetune)  # the other seeds: the paper's lr and seed 0's best validation lr
  for s in $SETTINGS; do for seed in $SEEDS; do for obj in dpace e2e edr; do
    for lr in $PAPER_LR $(best_lr "$s" 0 "$obj"); do
      finetune "ft-$s-s$seed-$obj-$lr" "$s" "$seed" "$obj" "$lr"
    done
  done; done; done ;;
compare)  # test rollouts: every fine-tune vs its start, and vs the continued-D-PACE control
  for s in $SETTINGS; do for seed in $SEEDS; do
    runs=()
    for obj in dpace e2e edr; do
      for lr in $(printf '%s\n' $PAPER_LR $(best_lr "$s" 0 "$obj") | sort -u); do
        runs+=("$R/ft-$s-s$seed-$obj-$lr")
      done
    done
    ev="--target tiny --rollouts $OUT/rollouts/test-$s --cache-dir $OUT/cache --no-progress"
    $BD compare $ev --json "$OUT/json/compare_$s-s$seed.json" "$R/base-$s-s$seed" "${runs[@]}"
    for ctl in "${runs[@]}"; do case $ctl in *-dpace-*)
      $BD compare $ev --json "$OUT/json/compare_$s-s$seed.vs-$(basename "$ctl").json" "$ctl" "${runs[@]}" ;;
    esac; done
    $BD eval $ev --json "$OUT/json/eval_$s-s$seed.json" ngram "$R/base-$s-s$seed" "${runs[@]}"
  done; done ;;
greedy)  # T = 0: why greedy EDR fine-tunes hurt (checkpoints every 8 steps for the curves)
  for seed in $SEEDS; do
    g() { finetune "g-s$seed-$1" t0 "$seed" "$2" "$3" checkpoint.save_every=8 checkpoint.keep_last=8 "${@:4}"; }
    g dpace-3e-4 dpace 3e-4
    g e2e-3e-4 e2e 3e-4 objective.greedy_temperature=1
    for lr in 3e-4 3e-5 1e-5; do g "edr-b1-$lr" edr "$lr" objective.greedy_temperature=1; done
    for b in ${BETAS:-0.5 0.25 0.1}; do g "edr-b$b-3e-4" edr 3e-4 objective.greedy_temperature="$b"; done
    g edr-b1-3e-4-m32 edr 3e-4 objective.max_anchors=32 objective.greedy_temperature=1
    # a weaker start: the base's half-way checkpoint
    mid=$(ls -d "$R/base-t0-s$seed"/checkpoints/step-* | sort -t- -k2 -n | sed -n 2p)
    g half-dpace-3e-4 dpace 3e-4 drafter.init_from="$mid"
    g half-edr-b1-3e-4 edr 3e-4 drafter.init_from="$mid" objective.greedy_temperature=1
  done ;;
greedy-fix)  # T = 0, every seed: the tempered relaxation picked on validation (beta 0.5)
  # for EDR, and the same relaxation for E2E's greedy overlap
  for seed in $SEEDS; do
    g() { finetune "g-s$seed-$1" t0 "$seed" "$2" "$3" "${@:4}"; }
    g dpace-3e-4 dpace 3e-4
    g e2e-3e-4 e2e 3e-4 objective.greedy_temperature=1
    g e2e-3e-5 e2e 3e-5 objective.greedy_temperature=1
    g edr-b1-3e-4 edr 3e-4 objective.greedy_temperature=1
    g edr-b0.5-3e-4 edr 3e-4 objective.greedy_temperature=0.5
    g e2e-b0.5-3e-4 e2e 3e-4 objective.greedy_temperature=0.5
    runs=("$R/g-s$seed-dpace-3e-4" "$R/g-s$seed-e2e-3e-4" "$R/g-s$seed-e2e-3e-5" \
          "$R/g-s$seed-e2e-b0.5-3e-4" "$R/g-s$seed-edr-b1-3e-4" "$R/g-s$seed-edr-b0.5-3e-4")
    ev="--target tiny --rollouts $OUT/rollouts/test-t0 --cache-dir $OUT/cache --no-progress"
    $BD compare $ev --json "$OUT/json/compare_t0-s$seed.json" "$R/base-t0-s$seed" "${runs[@]}"
    $BD compare $ev --json "$OUT/json/compare_t0-s$seed.vs-control.json" "${runs[@]}"
    $BD eval $ev --json "$OUT/json/eval_t0-s$seed.json" ngram "$R/base-t0-s$seed" "${runs[@]}"
  done ;;
budget)  # every setting and seed: EDR on a bounded number of round starts per rollout
  # drafted with gradient (issue #31's cost goal: max_anchors M, the rest scored without),
  # next to EDR on all of them, E2E and the continued-D-PACE control (lr 3e-4; at T = 0
  # the greedy-fix runs, tempered beta 0.5)
  for s in $SETTINGS; do for seed in $SEEDS; do
    if [ "$s" = t0 ]; then
      p="g-s$seed"; beta="objective.greedy_temperature=0.5"
      ctl=dpace-3e-4; e2e=e2e-b0.5-3e-4; edr=edr-b0.5-3e-4
    else
      p="ft-$s-s$seed"; beta=""; ctl=dpace-3e-4; e2e=e2e-3e-4; edr=edr-3e-4
      finetune "$p-$ctl" "$s" "$seed" dpace 3e-4
      finetune "$p-$e2e" "$s" "$seed" e2e 3e-4
      finetune "$p-$edr" "$s" "$seed" edr 3e-4
    fi
    runs=("$R/$p-$ctl" "$R/$p-$e2e" "$R/$p-$edr")
    for m in ${BUDGETS:-32}; do for sampler in ${SAMPLERS:-gradient uniform}; do
      # shellcheck disable=SC2086
      finetune "$p-$edr-m$m-$sampler" "$s" "$seed" edr 3e-4 $beta \
          objective.max_anchors="$m" objective.anchor_sampler="$sampler"
      runs+=("$R/$p-$edr-m$m-$sampler")
    done; done
    ev="--target tiny --rollouts $OUT/rollouts/test-$s --cache-dir $OUT/cache --no-progress"
    j="$OUT/json/compare_budget${TAG:-}_$s-s$seed"  # TAG: keeps an earlier sweep's tables
    $BD compare $ev --json "$j.json" "$R/base-$s-s$seed" "${runs[@]}"
    $BD compare $ev --json "$j.vs-control.json" "${runs[@]}"
    $BD compare $ev --json "$j.vs-e2e.json" "${runs[@]:1}"
    $BD compare $ev --json "$j.vs-edr.json" "${runs[@]:2}"
  done; done ;;
relax)  # relaxed vs true expected rounds per checkpoint (validation rollouts)
  for seed in $SEEDS; do
    $PY research/scripts/edr_relaxation.py --target tiny --rollouts "$OUT/rollouts/val-t0" \
        --limit 24 --steps 0,16,32,48 --betas 1,0.5,0.25 --json "$OUT/json/relax_t0-s$seed.json" \
        "$R/g-s$seed-edr-b1-3e-4" "$R/g-s$seed-edr-b0.5-3e-4" "$R/g-s$seed-dpace-3e-4" \
        | tee "$OUT/json/relax_t0-s$seed.md"
  done ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
