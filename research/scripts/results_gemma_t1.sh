#!/usr/bin/env bash
# Gemma-3-270m at T = 1 (session 6; research/gemma.md, "Sampling"): the lookup-input
# D-PACE drafter trained on *sampled* (T = 1) rollouts, against prompt lookup and against
# the same drafter trained on greedy rollouts, offline (exact expected MAL at T = 1 on 64
# held-out test questions) and in wall-clock next to HF generate. Reuses the stages of
# research/scripts/gemma_gsm8k.sh with TEMP=1 and its own output directory.
#   OUT        output directory of this run (default results_runs/gemma3-t1)
#   GREEDY_RUN the greedy lookup-input drafter to compare (default results_runs/gemma3/...)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-results_runs/gemma3-t1} TEMP=1 SEEDS=${SEEDS:-0} OBJS=dpace
GREEDY_RUN=${GREEDY_RUN:-results_runs/gemma3/runs/lookup-dpace-s0}
SECTIONS=${*:-"rollouts features train-lookup eval"}
BD=.venv/bin/blockdraft
for section in $SECTIONS; do case $section in
rollouts|features|train-lookup) bash research/scripts/gemma_gsm8k.sh "$section" ;;
eval)
  $BD eval --target gemma-3-270m --rollouts "$OUT/rollouts/eval" --cache-dir "$OUT/cache" \
      --threads 2 --no-progress --json "$OUT/json/eval.json" \
      ngram "$OUT/runs/lookup-dpace-s0" "$GREEDY_RUN" | tee "$OUT/json/eval.txt"
  $BD compare --target gemma-3-270m --rollouts "$OUT/rollouts/eval" --cache-dir "$OUT/cache" \
      --threads 2 --no-progress --json "$OUT/json/compare.json" \
      ngram "$OUT/runs/lookup-dpace-s0" "$GREEDY_RUN" | tee "$OUT/json/compare.txt" ;;
decode)
  .venv/bin/python bench/decode.py --target gemma-3-270m \
      --prompts-spec "${DATA:-../shared/data}/gsm8k/test.jsonl:question" --prompts 4 \
      --max-new-tokens 64 --temperature 1 --threads 1 --reps 3 \
      --drafter "$OUT/runs/lookup-dpace-s0" "$GREEDY_RUN" | tee "$OUT/json/bench_decode.txt" ;;
*) echo "unknown section $section" >&2; exit 2 ;;
esac; done
