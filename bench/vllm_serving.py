"""vLLM at batch 1: no speculation vs prompt lookup, suffix decoding and trained drafters.

Why: `serve-check` runs one way after another, so a drift in the machine's speed (another
job, a frequency change) lands on whichever way ran then; its tokens/s rank ways only
roughly. Here every way has its own engine, all started first, and each prompt is served
by every way in turn (the order rotating from prompt to prompt), so every way sees the
same conditions and the ratios are paired per prompt. Several drafters can run side by
side (an export over the draft vocabulary next to the same weights over the whole one),
and `--draft-lengths 7,4` serves each speculative way at each of those K (a drafter then
fills a block shorter than it was trained on: lossless, fewer accepted). A drafter may be a
spec: `trim:conf=0.3:RUN` proposes each step only its confident prefix; `--drafter X@K`
serves X at K only, whatever `--draft-lengths` says.

    python bench/vllm_serving.py --target smollm2-135m --rollouts SUITE/gsm8k-* \
        --rollouts SUITE/humaneval-* --rollouts SUITE/mt-bench-* --limit 6 \
        --drafter RUN/lookup-2000-x2-edr-s0 --drafter trim:conf=0.3:RUN/lookup-2000-x2-edr-s0

Prints tokens/s over all prompts (token-weighted), the ratio to no speculation and to
`ngram` with a 95% bootstrap CI over prompts, tau (tokens per target step after the first
token, steps without a proposal included: the served MAL), the tokens drafted a step and
how many outputs equal no speculation's (greedy: all must).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import random
import tempfile
import time
from pathlib import Path

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.engines.vllm_engine import Vllm
from blockdraft.serialization.drafter_spec import DrafterSpec, checkpoint_of, display_name
from blockdraft.serialization.export import export_config, export_drafter
from blockdraft.serving.serve_check import speculation
from blockdraft.targets.registry import load_target, model_directory
from blockdraft.threads import configure_cpu


def _cpu() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    ):
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor()


def _ratio_ci(a: list[tuple[int, float]], b: list[tuple[int, float]], n_boot: int = 2000):
    """Tokens/s of `a` over `b` (sums over prompts) and its 95% bootstrap CI over prompts."""

    def ratio(idx):
        return (sum(a[i][0] for i in idx) / sum(a[i][1] for i in idx)) / (
            sum(b[i][0] for i in idx) / sum(b[i][1] for i in idx)
        )

    n, rng = len(a), random.Random(0)
    boots = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(n_boot))
    return ratio(range(n)), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def _shown(ratio_ci: tuple[float, float, float]) -> str:
    r, lo, hi = ratio_ci
    return f"{r:.2f}x [{lo:.2f}, {hi:.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="run, checkpoint or export, or a hybrid:/trim: spec of one; X@K: at K only",
    )
    p.add_argument("--rollouts", action="append", required=True, help="prompts and settings")
    p.add_argument("--limit", type=int, default=6, help="prompts of each rollout set")
    p.add_argument("--ways", default="none,ngram,suffix", help="vLLM's own ways")
    p.add_argument(
        "--draft-lengths", default="", help="K of every speculative way (default: the drafter's)"
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if "none" not in args.ways.split(","):
        raise SystemExit("vllm_serving.py: --ways must include none (the ratios' base)")
    configure_cpu(args.threads, "cpu")
    target = load_target(args.target, progress=False)
    folder, stop = model_directory(target), list(target.stop_token_ids)
    rows = []
    for d in args.rollouts:
        rs = RolloutSet.open(d)
        rows += [(rs.settings, r) for r in list(rs)[: args.limit]]
    if any(not s.greedy for s, _ in rows):
        raise SystemExit("vllm_serving.py: greedy rollouts only (outputs are compared)")
    kind, engines, k_of = Vllm(), {}, {}
    with tempfile.TemporaryDirectory(prefix="bd-bench-") as tmp, contextlib.ExitStack() as stack:
        exports = []
        for text in args.drafter:
            head, at, fixed = text.rpartition("@")
            text, fixed_k = (head, int(fixed)) if at and fixed.isdigit() else (text, None)
            spec = DrafterSpec.parse(text)
            ckpt = checkpoint_of(spec)
            name = display_name(spec) or Path(text.rstrip("/")).name
            conf = spec.min_confidence if spec.kind in ("hybrid", "trim") else None
            confs = {f"{spec.kind}_conf": conf} if conf is not None else {}
            cfg = export_config(ckpt, **confs)
            k = int(cfg.get("block_size") or cfg["dflash_config"]["block_size"]) - 1
            out = export_drafter(ckpt, Path(tmp) / f"export-{len(exports)}", target=target, **confs)
            exports.append((name, str(out), k, fixed_k))
        k0 = exports[0][2] if exports else 7
        lengths = [int(x) for x in filter(None, args.draft_lengths.split(","))] or [k0]
        plan = {}
        for way in filter(None, args.ways.split(",")):
            for k in [0] if way == "none" else lengths:
                plan[way if k in (0, k0) else f"{way}@{k}"] = (way, None, k)
        for name, export, k, fixed_k in exports:
            for n in [fixed_k] if fixed_k else lengths:
                plan[name if n == k else f"{name}@{n}"] = ("dflash", export, n)
        for label, (way, export, k) in plan.items():
            print(f"[bench] starting vLLM: {label}", flush=True)
            engines[label] = stack.enter_context(
                kind.load(
                    folder,
                    dtype="float32",
                    speculation=speculation(way, export, k),
                    max_model_len=target.context_length or 4096,
                )  # fmt: skip
            )
            k_of[label] = k
        labels = list(engines)
        timed = {w: [] for w in labels}
        outputs = {w: [] for w in labels}
        before = {w: engines[w].counters() for w in labels if w != "none"}
        for i, (settings, r) in enumerate(rows):
            order = labels[i % len(labels) :] + labels[: i % len(labels)]
            for w in order:
                started = time.perf_counter()
                out = engines[w].generate([r.prompt_ids.tolist()], settings, stop, [0])[0]
                timed[w].append((len(out.response_ids), time.perf_counter() - started))
                outputs[w].append(out.response_ids)
            print(f"[bench] prompt {i + 1}/{len(rows)}", flush=True)
        counted = {w: engines[w].counters().minus(before[w]) for w in before}
    tokens = sum(n for n, _ in timed["none"]) if "none" in timed else 0
    print(f"\n{target.name} in vLLM {kind.version()}, batch 1, {args.threads} thread(s), "
          f"{_cpu()}; {len(rows)} prompts, {tokens} tokens a way, interleaved")  # fmt: skip
    # prompt lookup at the first draft length asked for: the free baseline to beat
    ref = next((w for w in labels if plan[w][0] == "ngram"), None)
    print(f"| way | K | tokens/s | vs none [95% CI] | vs {ref or 'ngram'} [95% CI] | tau | "
          "drafted a step | outputs = none |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for w in labels:
        tps = sum(n for n, _ in timed[w]) / sum(s for _, s in timed[w])
        vs_none = _shown(_ratio_ci(timed[w], timed["none"]))
        vs_ref = _shown(_ratio_ci(timed[w], timed[ref])) if ref else "-"
        same = sum(a == b for a, b in zip(outputs[w], outputs["none"], strict=True))
        n = sum(t for t, _ in timed[w]) - len(rows)  # tokens after each prompt's first
        c = counted.get(w)
        steps = max(n - (c.accepted if c else 0), 1)
        drafted = f"{c.draft_tokens / steps:.2f}" if c else "-"
        print(f"| {w} | {k_of[w] or '-'} | {tps:.1f} | {vs_none} | {vs_ref} | {n / steps:.3f} | "
              f"{drafted} | {same}/{len(rows)} |")  # fmt: skip


if __name__ == "__main__":
    main()
