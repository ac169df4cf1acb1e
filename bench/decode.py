"""Decoding side by side in one run: HF generate, HF prompt lookup, and blockdraft's loops.

    python bench/decode.py --target gemma-3-270m --temperature 0 1
    python bench/decode.py --target tiny --drafter runs/dpace/final hybrid:runs/dpace
    python bench/decode.py --target gemma-shaped --drafter untrained --draft-vocab 32768

Rows, on the same target, prompts and thread count, timed round-robin per prompt (every
method decodes prompt i before any decodes prompt i+1, in reversed order on odd
prompts), so machine drift hits all alike:

- `HF generate`: `model.generate` (greedy, or sampling at T with top-k/top-p off, or at
  `--top-p` / `--top-k`, which every sampled row then uses);
- `HF prompt lookup`: `generate(prompt_lookup_num_tokens=K)` (HF's assisted decoding;
  its rounds are counted with a forward hook on the model, so it gets a tau too);
- `AR loop`: blockdraft's autoregressive baseline (`decoding.loop.ar_generate`), with
  the lean forward where the target is small enough (decoding/cpu/lean_target.py; the
  speculative rows use it too), and `AR loop, HF forward` the same loop on HF's forward;
- `spec ngram`: blockdraft's loop with `NgramDrafter(K, max=2, match=first)`: the rule
  and settings of HF prompt lookup, so at T = 0 both emit the same tokens in the same
  rounds and the tokens/s ratio compares the two loops alone;
- `spec <drafter>`: blockdraft's loop with a trained drafter (a checkpoint path) or
  `untrained` (random weights, the shape of a 1-layer DFlash drafter; its timing is what
  matters at Gemma's shape, its tau is ~1).

Every row prints on how many prompts its output equals HF generate's (T = 0: the exact
methods must agree), tokens/s and its ratio to HF generate's (ratio of sums, and the
median of the per-prompt ratios, robust to one disturbed prompt); speculative rows add
tau and the mean time of one round split into draft (drafter forward and context
update / n-gram lookup), target (verification forward), verify (acceptance test and
sampling) and other (cache crop, bookkeeping), in ms and in AR steps (one AR-loop forward
+ token choice). A first table times single target forwards at the prompts' context lengths:
one token (an AR step) against K+1 tokens with and without the features a drafter
needs, and as the T = 0 loop runs it (argmax only: the screened head where the target
has a large vocabulary, see decoding/target_runner.py): the verification cost that
bounds every speedup. docs/decoding.md explains the
cost model (speedup = tau / round cost in AR steps).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blockdraft.decoding.cpu.lean_target import LeanTarget
from blockdraft.decoding.hf_generate import hf_generate_job
from blockdraft.decoding.loop import StepStats, ar_generate, speculative_generate
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.kernels.argmax_screen import Int8Screen, ScreenedArgmaxHead
from blockdraft.kernels.packed_linear import PackedLinears

PHASES = ("draft", "target", "verify", "other")


def gemma_shaped_target() -> Any:
    """Random weights at Gemma 3 270M's shape (262k vocabulary): timing without the download."""
    from fixture_targets import make_shaped_target

    return make_shaped_target("gemma-3-270m")


def load(args: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    if args.target == "gemma-shaped":
        target = gemma_shaped_target()
    elif args.target == "random":
        from fixture_targets import make_random_target

        target = make_random_target("qwen3", hidden_size=256, num_layers=8)
    else:
        from blockdraft.targets.registry import load_target

        target = load_target(args.target)
    if args.target in ("gemma-shaped", "random"):
        g = torch.Generator().manual_seed(0)
        vocab = len(target.tokenizer)
        prompts = [
            torch.randint(3, vocab, (48,), generator=g).tolist() for _ in range(args.prompts)
        ]
    else:
        from blockdraft.data.prompt_specs import load_prompts, render_prompt

        prompts = [render_prompt(target.tokenizer, p) for p in load_prompts(args.prompts_spec)]
        prompts = [p[-args.max_prompt_tokens :] for p in prompts][: args.prompts]
    return target, prompts


def load_drafter(
    spec: str, args: argparse.Namespace, target: Any, dtype: torch.dtype | None = None
) -> tuple[str, Any]:
    """(row name, drafter) for one `--drafter` value: `untrained`, a checkpoint / run
    directory, or any spec `blockdraft decode` takes (e.g. `hybrid:RUN`)."""
    if spec == "untrained":
        from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

        torch.manual_seed(0)
        cfg = DrafterConfig.for_target(
            target, num_layers=1, block_size=args.k + 1, draft_vocab_size=args.draft_vocab
        )
        return "spec untrained", BlockDrafter(cfg).bind_target(target).eval()
    from blockdraft.serialization.drafter_spec import DrafterSpec, display_name, load_drafter_spec

    drafter, _ = load_drafter_spec(DrafterSpec.parse(spec), target, dtype=dtype)
    name = display_name(DrafterSpec.parse(spec))
    if name is None:
        path = Path(spec).resolve()
        name = path.parent.name if path.name in ("final", "best") else path.name
    suffix = "" if dtype in (None, torch.float32) else f" {str(dtype).removeprefix('torch.')}"
    return f"spec {name}{suffix}", drafter


class ForwardCounter:
    """Counts target forwards of every method (a hook on the decoder stack, plus the
    lean forward's own count where the loops take it)."""

    def __init__(self, model: torch.nn.Module, lean: LeanTarget | None) -> None:
        self.hf_calls = 0
        self.lean = lean
        model.register_forward_pre_hook(self._hook)

    @property
    def calls(self) -> int:
        return self.hf_calls + (self.lean.calls if self.lean is not None else 0)

    def _hook(self, *_: Any) -> None:
        self.hf_calls += 1


def verify_cost(target: Any, prompts: list[list[int]], k: int, reps: int) -> dict[str, float]:
    """Mean seconds of one target forward on top of each prompt's cache: 1 token vs K+1
    (the target's greedy continuation, i.e. a fully accepted draft; the screens' worst
    case, random tokens, in a row of its own).

    The argmax cases run the T = 0 verification the ways the loop can: `F.linear` layers
    with the loop's screened head (no MKL packing), and packed fp32 layers
    (kernels/packed_linear.py) with the packed fp32 head, the bf16 screen or the int8
    screen (kernels/argmax_screen.py; the loop takes int8 where this CPU has exact
    int8 products); and sampled verification under a top-k 20 cutoff through the loop's
    screen (`top_k_logits`)."""
    run, fp32_head = TargetRunner(target), TargetRunner(target)
    fp32_head.screen = None  # the packed fp32 head, whatever `use_packed_weights` picks
    packs = PackedLinears.of(target.model)
    one = dict(keep=1, features=False, argmax=False)
    plain = dict(keep=k + 1, features=True, argmax=True)
    cases: dict[str, tuple[TargetRunner, bool, dict[str, Any]]] = {}
    if run.lean is not None:  # the loops' lean forward, next to the HF forward it replaces
        hf = TargetRunner(target, lean=False)
        cases["HF forward: 1 token"] = (hf, False, one)
        cases[f"HF forward: {k + 1} argmax + features"] = (hf, False, plain)
    cases |= {
        "1 token": (run, False, one),
        f"{k + 1} tokens": (run, False, dict(keep=k + 1, features=False, argmax=False)),
        f"{k + 1} + features": (run, False, dict(keep=k + 1, features=True, argmax=False)),
        f"{k + 1} argmax + features": (run, False, plain),
    }
    if packs is not None and run.lean is None:
        cases[f"{k + 1} argmax, packed + fp32 head"] = (fp32_head, True, plain)
        if run.screen is not None:
            head = target.model.get_output_embeddings().weight
            loop_kind = "int8" if isinstance(run.screen.screen, Int8Screen) else "bf16"
            for kind in ("bf16", "int8"):
                screened = TargetRunner(target)  # the loop's own screen where it is this kind
                try:
                    if kind != loop_kind:
                        screened.screen = ScreenedArgmaxHead(head, kind=kind)
                except RuntimeError:  # no exact int8 products on this CPU
                    continue
                cases[f"{k + 1} argmax, packed + {kind} screen"] = (screened, True, plain)
            # T > 0 under a top-k cutoff (the EDR paper's 20): the loop's screen
            top_k = dict(keep=k + 1, features=True, argmax=False, top_k=20)
            cases[f"{k + 1} top-20 logits, packed + {loop_kind} screen"] = (run, True, top_k)
    worst = [name for name in cases if name.endswith("int8 screen")]
    for name in worst:  # the screen's cost depends on the text: random tokens are its worst
        cases[name + ", random tokens"] = cases[name]
    out: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for prompt in prompts:
            pre = run.step(torch.tensor([prompt]), croppable=True)
            n = len(prompt)
            # one cache per kind of forward (the lean forward keeps its own)
            caches = {run.lean is not None: pre.cache}
            for runner, _, _ in cases.values():
                key = runner.lean is not None
                if key not in caches:
                    caches[key] = runner.step(torch.tensor([prompt]), croppable=True).cache
            cache = pre.cache
            # the block a fully accepted draft verifies: the target's own continuation
            greedy = [pre.argmax()[-1]]
            for _ in range(k):
                step = run.step(torch.tensor([greedy[-1:]]), cache)
                greedy.append(step.argmax()[-1])
            run.crop(cache, n)
            block = torch.tensor([greedy])
            g = torch.Generator().manual_seed(n)
            noise = torch.randint(3, len(target.tokenizer), (1, k + 1), generator=g)
            for _ in range(reps):
                for name, (runner, packed, c) in cases.items():
                    ids = noise if name.endswith("random tokens") else block
                    ids = ids if c["keep"] > 1 else ids[:, :1]
                    own = caches[runner.lean is not None]
                    with packs.active() if packed else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        runner.step(ids, own, **c)
                        out[name].append(time.perf_counter() - t0)
                    runner.crop(own, n)
    return {name: statistics.median(v) for name, v in out.items()}


def bench_temperature(
    target: Any, prompts: list[list[int]], drafters: dict[str, Any], temp: float, args: Any
) -> list[dict[str, Any]]:
    n, k = args.max_new_tokens, args.k
    cutoffs = {} if temp == 0 else {"top_p": args.top_p, "top_k": args.top_k}
    lean = LeanTarget.of(target.model, target.layer_ids)
    counter = ForwardCounter(target.model.get_decoder(), lean)  # every path runs the decoder
    rows: dict[str, dict[str, Any]] = {}

    def row(name: str) -> dict[str, Any]:
        fresh = {"name": name, "s": 0.0, "tokens": 0, "rounds": 0, "emitted": 0}
        return rows.setdefault(name, {**fresh, "phases": dict.fromkeys(PHASES, 0.0)})

    ar_stats = StepStats()
    for i, prompt in enumerate(prompts):
        jobs: dict[str, Callable[[], Any]] = {
            "HF generate": hf_generate_job(target, prompt, temp, n, **cutoffs),
            "HF prompt lookup": hf_generate_job(target, prompt, temp, n, lookup=k, **cutoffs),
            "AR loop, HF forward": lambda p=prompt, i=i: ar_generate(
                target,
                p,
                temperature=temp,
                max_new_tokens=n,
                lean=False,
                generator=torch.Generator().manual_seed(i),
                **cutoffs,
            ),  # fmt: skip
            "AR loop": lambda p=prompt, i=i: ar_generate(
                target,
                p,
                temperature=temp,
                max_new_tokens=n,
                stats=ar_stats,
                generator=torch.Generator().manual_seed(i),
                **cutoffs,
            ),  # fmt: skip
        }
        if lean is None:  # the AR loop runs the HF forward anyway
            del jobs["AR loop, HF forward"]
        for name, drafter in drafters.items():
            jobs[name] = lambda d=drafter, p=prompt, i=i: speculative_generate(
                target, d, p, temperature=temp, max_new_tokens=n,
                generator=torch.Generator().manual_seed(i), **cutoffs,
            )  # fmt: skip
        # every method on this prompt, in reversed order on odd prompts
        order = [(k, j) for k, j in jobs.items() if not args.methods or k in args.methods]
        for name, job in order if i % 2 == 0 else order[::-1]:
            calls = counter.calls
            t0 = time.perf_counter()
            result = job()
            r = row(name)
            r["s"] += time.perf_counter() - t0
            tokens = result.tokens if hasattr(result, "emitted") else result
            r.setdefault("outputs", []).append(list(tokens))
            n_tok = len(tokens)
            r.setdefault("per_prompt", []).append(n_tok / (time.perf_counter() - t0))
            if hasattr(result, "emitted"):  # a blockdraft speculative trace
                r["tokens"] += len(result.tokens)
                r["rounds"] += len(result.emitted)
                r["emitted"] += sum(result.emitted)
                for ph in PHASES:
                    r["phases"][ph] += result.seconds.get(ph, 0.0)
            else:
                r["tokens"] += len(result)
                if name == "HF prompt lookup":
                    # HF's first forward is prefill *and* a round (it verifies candidates
                    # looked up in the prompt); ours emits x_1 from a candidate-free
                    # prefill (METHODS.md). tau here: tokens after x_1 / later forwards;
                    # tok/fwd (all tokens / all forwards) compares the two exactly.
                    r["rounds"] += counter.calls - calls - 1
                    r["emitted"] += len(result) - 1
            r["forwards"] = r.get("forwards", 0) + counter.calls - calls
    ar_step = ar_stats.step_s / max(ar_stats.steps, 1) if ar_stats.steps else float("nan")
    base = rows["HF generate"]["tokens"] / rows["HF generate"]["s"]
    hf_tps = rows["HF generate"]["per_prompt"]
    for r in rows.values():
        ratios = [t / h for h, t in zip(hf_tps, r["per_prompt"], strict=True)]  # tok/s ratios
        r["median_ratio"] = statistics.median(ratios)
        r["tok_s"] = r["tokens"] / r["s"]
        same = sum(
            a == b for a, b in zip(r["outputs"], rows["HF generate"]["outputs"], strict=True)
        )
        r["same_as_hf"] = f"{same}/{len(r['outputs'])}"
        r["speedup"] = r["tok_s"] / base
        r["tau"] = r["emitted"] / r["rounds"] if r["rounds"] else None
        if r["rounds"] and r["name"].startswith("spec"):
            r["round_ms"] = {ph: 1e3 * v / r["rounds"] for ph, v in r["phases"].items()}
            r["round_ar_steps"] = sum(r["round_ms"].values()) / (1e3 * ar_step)
    if "AR loop" in rows:
        rows["AR loop"]["ar_step_ms"] = 1e3 * ar_step
    return list(rows.values())


def print_rows(temp: float, rows: list[dict[str, Any]]) -> None:
    ar_ms = next((r["ar_step_ms"] for r in rows if r["name"] == "AR loop"), float("nan"))
    print(f"\nT = {temp:g}   (AR step = {ar_ms:.2f} ms: one AR-loop forward + token choice)")
    head = f"{'method':<28}{'=HF':>5}{'tau':>6}{'tok/fwd':>8}{'tok/s':>9}{'vs HF':>7}{'median':>8}"
    print(head + "   per round ms: draft / target / verify / other = total (AR steps)")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        same = r["same_as_hf"] if temp == 0 else "-"
        per_fwd = r["tokens"] / max(r["forwards"], 1)
        line = f"{r['name']:<28}{same:>5}{tau:>6}{per_fwd:>8.2f}{r['tok_s']:>9.1f}"
        line += f"{r['speedup']:>6.2f}x"
        line += f"{r['median_ratio']:>7.2f}x"
        if "round_ms" in r:
            ms = r["round_ms"]
            parts = " / ".join(f"{ms[p]:.2f}" for p in PHASES)
            line += f"   {parts} = {sum(ms.values()):.2f} ({r['round_ar_steps']:.2f})"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--target", default="tiny", help="tiny | gemma-3-270m | gemma-shaped | random | HF path"
    )
    ap.add_argument(
        "--drafter", nargs="*", default=[],
        help="drafters to time (one row each): checkpoint/run dirs, `hybrid:RUN`, or "
        "`untrained` (random weights, timing only)",
    )  # fmt: skip
    ap.add_argument(
        "--drafter-dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="dtypes the trained drafters run in, one row each (the target stays as loaded)",
    )
    ap.add_argument("--draft-vocab", type=int, default=None, help="reduced vocab of `untrained`")
    ap.add_argument(
        "--k", type=int, default=7, help="proposals per round (ngram, HF lookup, untrained)"
    )
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompts-spec", default="stdlib:eval", help="prompt spec for named targets")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled rows' top-p (1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="sampled rows' top-k (0: off)")
    ap.add_argument("--reps", type=int, default=5, help="repeats of the forward-cost table")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--methods", type=lambda s: s.split(","), default=None,
        help="comma-separated subset of rows, e.g. 'HF generate,AR loop' (HF generate is required)",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target, prompts = load(args)
    drafters: dict[str, Any] = {"spec ngram": NgramDrafter(args.k, max_ngram=2, match="first")}
    for spec in args.drafter:
        for dtype_name in args.drafter_dtype:
            name, drafter = load_drafter(spec, args, target, getattr(torch, dtype_name))
            drafters[name if name not in drafters else f"spec {spec}"] = drafter  # same run name
    params = sum(p.numel() for p in target.model.parameters()) / 1e6
    lens = [len(p) for p in prompts]
    print(
        f"target {target.name} ({params:.0f}M params, vocab {target.vocab_size}), "
        f"{len(prompts)} prompts of {min(lens)}-{max(lens)} tokens x {args.max_new_tokens} new, "
        f"K={args.k}, {args.threads} thread(s), torch {torch.__version__}"
    )
    for name, drafter in list(drafters.items())[1:]:
        inner = getattr(drafter, "drafter", drafter)  # a hybrid's trained part
        dp = sum(p.numel() for p in inner.parameters()) / 1e6
        vocab = inner.config.draft_vocab_size or target.vocab_size
        print(f"{name}: {dp:.1f}M params (+ shared head over {vocab} tokens)")
    # warm-up: first calls pay one-off allocation and dispatch costs
    for temp in args.temperature:
        bench_temperature(
            target,
            prompts[:1],
            drafters,
            temp,
            argparse.Namespace(**{**vars(args), "max_new_tokens": 4}),
        )
    cost = verify_cost(target, prompts, args.k, args.reps)
    one = cost["1 token"]
    print("\nsingle target forwards on the prompts' caches (median):")
    for name, s in cost.items():
        print(f"  {name:<48}{1e3 * s:8.2f} ms  {s / one:5.2f}x one token")
    if args.top_p < 1 or args.top_k:
        print(f"\nsampled rows (T > 0): top-p {args.top_p:g}, top-k {args.top_k or 'off'}")
    for temp in args.temperature:
        print_rows(temp, bench_temperature(target, prompts, drafters, temp, args))


if __name__ == "__main__":
    main()
