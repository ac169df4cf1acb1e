#!/usr/bin/env bash
# Prompt lookup on the gemma-3-270m suite (GSM8K, HumanEval, MT-Bench): builds and caches the
# suite's rollouts, then scores `ngram` alone. Output outside git in $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results_runs/suite-gemma}
mkdir -p "$OUT"
.venv/bin/blockdraft suite --target gemma-3-270m --suite configs/suites/gemma-3-270m.yaml \
    --rollouts-dir "$OUT/rollouts" --cache-dir "$OUT/cache" --threads ${THREADS:-2} \
    --no-progress --json "$OUT/ngram.json" --plot "$OUT/ngram.png" "$@"
