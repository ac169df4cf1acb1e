#!/usr/bin/env bash
# The GPU check (issue 30): tests/gpu, then every measured part of bench/gpu_check.py in
# its own process under its own time limit, then the table. Results: $OUT/gpu_check.json
# and $OUT/gpu_check.log (OUT defaults to /tmp/gpu_check). No install and no network:
# the project runs from src/ (PYTHONPATH); python is $PYTHON or python3.
#   bash scripts/gpu_check.sh              # on a CUDA machine: under 8 minutes
#   bash scripts/gpu_check.sh --cpu-smoke  # the same parts at tiny shapes on the CPU
#   TARGET_LAYERS=8 BUDGET_S=450 PARTS="dpace edr" LIMIT_edr=90 bash scripts/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
SMOKE=""
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE="--cpu-smoke"; fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec > >(tee "$OUT/gpu_check.log") 2>&1
START=$SECONDS
BUDGET=${BUDGET_S:-450}            # seconds for all parts; the summary follows
LAYERS=${TARGET_LAYERS:-8}         # decoder layers of the Qwen3-8B-shaped target (of 36)
PARTS=${PARTS:-"tests matmul dpace edr e2e rollout decode"}
# seconds per part (LIMIT_<part> overrides; each is cut to what the budget has left)
declare -A LIMIT=([tests]=${LIMIT_tests:-140} [matmul]=${LIMIT_matmul:-20}
    [dpace]=${LIMIT_dpace:-70} [edr]=${LIMIT_edr:-75} [e2e]=${LIMIT_e2e:-55}
    [rollout]=${LIMIT_rollout:-45} [decode]=${LIMIT_decode:-45})

"$PY" bench/gpu_check.py --part preflight --work "$WORK" $SMOKE || exit 2
echo "gpu_check: $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader

run_part() {  # name limit command...: the limit shrinks to what the budget has left
    local name=$1 limit=$2 left rc
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        echo ">>> $name: skipped, budget spent"
        return
    fi
    echo ">>> [$((SECONDS - START)) s] $name (limit ${limit} s)"
    timeout -k 5 "$limit" "$@"
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo ">>> $name: TIMED OUT at ${limit} s"; fi
    echo ">>> [$((SECONDS - START)) s] $name done (exit $rc)"
}

for part in $PARTS; do
    if [ "$part" = tests ]; then
        if [ -n "$SMOKE" ]; then export BLOCKDRAFT_GPU_TESTS_ON_CPU=1; fi
        run_part tests "${LIMIT[tests]}" "$PY" -m pytest -v -p no:cacheprovider tests/gpu \
            -rfEs --junitxml="$WORK/tests.xml"
        unset BLOCKDRAFT_GPU_TESTS_ON_CPU
    else
        run_part "$part" "${LIMIT[$part]}" "$PY" bench/gpu_check.py --part "$part" \
            --work "$WORK" --target-layers "$LAYERS" $SMOKE
    fi
done
"$PY" bench/gpu_check.py --part summary --work "$WORK" --out "$OUT" --total-s $((SECONDS - START)) $SMOKE
cp "$WORK"/tests.xml "$OUT"/ 2>/dev/null || true  # the parts are inside gpu_check.json
echo "gpu_check: $((SECONDS - START)) s in all; $OUT/gpu_check.json, $OUT/gpu_check.log"
