"""`blockdraft decode --target NAME DRAFTER (--prompts SPEC | --rollouts DIR) [...]`.

Real speculative decoding at batch 1: tau, its CI and histogram, tokens/s and the speedup
over autoregressive decoding timed alternately in the same run. With `--rollouts DIR` the
prompts and settings come from a rollout set, and the drafter's offline MAL on it is
computed too: the online/offline agreement check of docs/methods.md in one command.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from blockdraft.cli.arguments import add_sampling_args, nonnegative_int, positive_int, user_error
from blockdraft.cli.drafter_options import (
    DRAFTER_HELP,
    add_json_arg,
    add_target_args,
    drafter_dtype_of,
    drafter_spec,
    setup_target,
    write_json_flag,
)
from blockdraft.data.prompt_specs import check_fits_context, load_prompts, render_prompt
from blockdraft.data.prompt_type import PromptError
from blockdraft.data.rollouts.store import RolloutSet, check_target
from blockdraft.decoding.hf_generate import has_hf_generate, versus_hf
from blockdraft.decoding.loop import decode
from blockdraft.evaluation.eval_compare import drafter_names
from blockdraft.evaluation.offline import mal_ci
from blockdraft.evaluation.scoring import score_rollout_set
from blockdraft.sampling import MAX_NEW_TOKENS
from blockdraft.serialization.drafter_spec import DrafterSpec, checkpoint_of, load_drafter_spec

EXAMPLE = """examples:
  blockdraft decode --target tiny blockdraft-demo/runs/dpace \\
      --rollouts blockdraft-demo/rollouts/eval/set --limit 8 --json decode.json
  blockdraft decode --target tiny ngram --prompts stdlib:eval --limit 4 --temperature 1
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "decode",
        help="real speculative decoding: tau, tokens/s and speedup vs autoregressive",
        description="Speculative decoding (greedy or lossless sampling) of prompts with a target "
        "and a drafter, timed alternately against plain autoregressive decoding.",
        epilog=EXAMPLE,
    )
    add_target_args(p)
    # positional, as in eval/compare/suite/serve-check; --drafter stays for older scripts
    p.add_argument("drafter", nargs="?", type=drafter_spec, metavar="DRAFTER", help=DRAFTER_HELP)
    p.add_argument(
        "--drafter",
        dest="drafter_flag",
        metavar="DRAFTER",
        type=drafter_spec,
        help="the same as the positional DRAFTER",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="prompt spec (as for `blockdraft rollout`)")
    src.add_argument(
        "--rollouts",
        help="rollout dir: use its prompts and sampling settings, and "
        "report the drafter's offline MAL on it for comparison",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts")
    add_sampling_args(
        p,
        {
            "temperature": "sampling temperature, 0 = greedy (default 0, or the rollouts' with "
            "--rollouts)",
            "top_p": "nucleus sampling cutoff in (0, 1] (default 1 = off, or the rollouts')",
            "top_k": "sample among the k most likely tokens (default 0 = off, or the rollouts')",
            "max_new_tokens": f"tokens generated per prompt (default {MAX_NEW_TOKENS}, or the "
            "rollouts')",
            "seed": "seed of the sampling (T > 0; default 0)",
        },
        {"seed": 0},
    )
    p.add_argument(
        "--verifier",
        choices=["standard", "block"],
        default="standard",
        help="lossless verification rule for T > 0 (block: Sun et al. 2024)",
    )
    p.add_argument(
        "--no-ar", action="store_true", help="skip the autoregressive baseline (no speedup)"
    )
    p.add_argument(
        "--vs-hf",
        action="store_true",
        help="also time HF generate against the AR loop on the same prompts (alternately) "
        "and report the speedup over HF generate",
    )
    add_json_arg(p)
    p.add_argument(
        "--show", type=nonnegative_int, default=1, help="print the first N decoded outputs"
    )
    p.set_defaults(func=run)


def _prompts_and_settings(
    args: argparse.Namespace, target: Any
) -> tuple[list[list[int]], dict[str, Any], Any]:
    settings: dict[str, Any] = {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": MAX_NEW_TOKENS
    }  # fmt: skip
    rollouts = None
    if args.rollouts:
        rollouts = RolloutSet.open(args.rollouts)
        check_target(rollouts, target, "--rollouts")  # as `eval` does: same target only
        if args.limit:
            rollouts = rollouts.subset(range(min(args.limit, len(rollouts))))
        settings = {k: getattr(rollouts.settings, k) for k in settings}
        prompts = [r.prompt_ids.tolist() for r in rollouts]
        prompt_ids = [str(r.prompt_id) for r in rollouts]
    else:
        loaded = load_prompts(args.prompts, limit=args.limit, allow_download=args.allow_download)
        prompts = [render_prompt(target.tokenizer, p) for p in loaded]
        prompt_ids = [p.id for p in loaded]
    for key in ("temperature", "top_p", "top_k", "max_new_tokens"):
        value = getattr(args, key)
        if value is not None:
            if rollouts is not None and value != settings[key]:
                raise ValueError(
                    f"--{key.replace('_', '-')} {value} differs from the rollouts' "
                    f"{settings[key]}: the offline comparison needs the same settings"
                )
            settings[key] = value
    check_fits_context(prompt_ids, prompts, target.context_length, settings["max_new_tokens"])
    return prompts, settings, rollouts


def _one_drafter(args: argparse.Namespace) -> DrafterSpec:
    """The drafter, given positionally or as `--drafter` (not both, not neither)."""
    given = [d for d in (args.drafter, args.drafter_flag) if d is not None]
    if len(given) != 1:
        raise ValueError(
            "decode takes one drafter: `blockdraft decode --target NAME DRAFTER ...`"
            + (" (given twice: positionally and as --drafter)" if given else "")
        )
    return given[0]


def run(args: argparse.Namespace) -> int:
    try:
        args.drafter = _one_drafter(args)
        ckpt = checkpoint_of(args.drafter)  # a missing checkpoint fails before the target loads
        target = setup_target(args)
        drafter, drafter_id = load_drafter_spec(
            args.drafter, target, dtype=drafter_dtype_of(args, target)
        )
        prompts, settings, rollouts = _prompts_and_settings(args, target)
        if args.vs_hf and not has_hf_generate(target):  # before any decoding is spent
            raise ValueError("--vs-hf: the target is not a Hugging Face model with generate()")
        if args.vs_hf and args.no_ar:
            raise ValueError("--vs-hf needs the AR baseline: drop --no-ar")
        result = decode(
            target,
            drafter,
            prompts,
            seed=args.seed,
            verifier=args.verifier,
            measure_ar=not args.no_ar,
            progress=not args.no_progress,
            **settings,
        )
        out: dict[str, Any] = {
            "drafter": drafter_names([args.drafter])[0],
            "path": str(ckpt) if ckpt is not None else None,
            "target": target.name,
            "drafter_dtype": str(getattr(drafter, "dtype", "")).removeprefix("torch.") or None,
            **result.to_dict(),
        }
        if args.vs_hf:
            out.update(versus_hf(target, prompts, result.speedup, **settings))
        if rollouts is not None:
            acc = score_rollout_set(
                drafter,
                target,
                rollouts,
                drafter_id=drafter_id,
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
            )
            mal, ci = mal_ci(acc)
            out.update(offline_mal=mal, offline_mal_ci95=list(ci), rollouts=str(args.rollouts))
    except (FileNotFoundError, ValueError, PromptError) as exc:
        return user_error(exc)
    for i, toks in enumerate(result.outputs[: args.show]):
        print(f"--- output {i} ({len(toks)} tokens) ---\n{target.decode(toks)}")
    lo, hi = result.tau_ci95
    print(
        f"prompts {len(prompts)}  rounds {result.num_rounds}  "
        f"tau {result.tau:.3f} [{lo:.3f}, {hi:.3f}]  "
        f"histogram (tokens/round 1..K+1) {result.histogram[1:]}"
    )
    if result.machine_busy or out.get("ar_vs_hf_busy"):
        load = max(result.other_load_cores or 0.0, out.get("ar_vs_hf_other_load_cores") or 0.0)
        print(
            f"note: other processes kept {load:.1f} cores busy while this was timed: the "
            "speeds below measured the machine as much as the drafter"
        )
    line = f"spec {result.tokens_per_s:.1f} tok/s"
    if result.speedup is not None:
        line += f"  AR {result.ar_tokens_per_s:.1f} tok/s  speedup {result.speedup:.2f}x"
        if result.speedup_ci95 is not None and not math.isnan(result.speedup_ci95[0]):
            line += " [{:.2f}, {:.2f}] over prompts".format(*result.speedup_ci95)
        line += " (timed alternately in this run)"
    print(line)
    if out.get("speedup_vs_hf") is not None:
        print(
            f"HF generate {out['hf_tokens_per_s']:.1f} tok/s  AR loop {out['ar_vs_hf']:.2f}x HF  "
            f"speculative {out['speedup_vs_hf']:.2f}x HF generate (speedup x AR/HF, each timed "
            "alternately)"
        )
    costs = result.round_costs()
    if costs and result.num_rounds:
        total = sum(costs.values())
        order = ["draft", "target", "verify", "other"]
        parts = "  ".join(f"{k} {1e3 * costs[k]:.2f}" for k in order if k in costs)
        line = f"per round (ms): {parts}  total {1e3 * total:.2f}"
        step = result.ar_step_s
        if step:
            line += f"  = {total / step:.2f} AR steps of {1e3 * step:.2f} ms"
        print(line)
    if "offline_mal" in out:
        lo2, hi2 = out["offline_mal_ci95"]
        print(f"offline MAL on the same rollouts {out['offline_mal']:.3f} [{lo2:.3f}, {hi2:.3f}]")
    write_json_flag(args, out)
    return 0
