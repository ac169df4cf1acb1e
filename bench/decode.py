"""Speculative vs autoregressive decoding wall-clock, measured alternately in one run.

    python bench/decode.py                      # random Qwen3 target, untrained drafter
    python bench/decode.py --target tiny --drafter runs/dpace/final --temperature 0

For every prompt the same target decodes autoregressively and speculatively back to back
(AR, spec, AR, spec, ...) with the same KV-cache code, so machine drift hits both alike;
the printed speedup is the ratio of tokens/s. With no `--drafter`, an untrained drafter
is used: at T=0 it is almost never right (tau ~ 1: the ratio shows the pure overhead of
drafting + verifying), at T=1 a random target and a random drafter are both near
uniform, so acceptance is high (the ratio shows what the loop gains at that tau).
"""

from __future__ import annotations

import argparse

import torch

from blockdraft.evaluation.online import decode


def _millions(module: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in module.parameters()) / 1e6:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="random", help="random | tiny | gemma-3-270m | HF path")
    ap.add_argument(
        "--drafter", default=None, help="drafter checkpoint (default: untrained drafter)"
    )
    ap.add_argument("--hidden", type=int, default=256, help="random target hidden size")
    ap.add_argument("--layers", type=int, default=8, help="random target layers")
    ap.add_argument("--block-size", type=int, default=8, help="untrained drafter block size")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--verifier", default="standard", choices=["standard", "block"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.target == "random":
        from blockdraft.models.testing import make_random_target

        target = make_random_target(
            "qwen3", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2
        )
    else:
        from blockdraft.models.registry import load_target

        target = load_target(args.target)
    if args.drafter:
        from blockdraft.models.checkpoint import load_drafter

        drafter = load_drafter(args.drafter, target).eval()
    else:
        from blockdraft.models.drafter import BlockDrafter, DrafterConfig

        torch.manual_seed(0)
        cfg = DrafterConfig.for_target(target, num_layers=1, block_size=args.block_size)
        drafter = BlockDrafter(cfg).bind_target(target).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, target.vocab_size, (16,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    print(
        f"target {target.name} ({_millions(target.model)}M params), "
        f"drafter {'untrained' if not args.drafter else args.drafter} "
        f"({_millions(drafter)}M params), K={drafter.config.num_proposals}, "
        f"{args.prompts} prompts x {args.max_new_tokens} tokens, {args.threads} thread(s)"
    )
    print(
        f"{'T':>4} {'tau':>6} {'tau 95% CI':>16} {'AR tok/s':>9} {'spec tok/s':>10} {'speedup':>8}"
    )
    for temp in args.temperature:
        r = decode(
            target,
            drafter,
            prompts,
            temperature=temp,
            max_new_tokens=args.max_new_tokens,
            verifier=args.verifier,
        )
        lo, hi = r.tau_ci95
        print(
            f"{temp:>4.1f} {r.tau:>6.2f} {f'[{lo:.2f}, {hi:.2f}]':>16} {r.ar_tokens_per_s:>9.1f} "
            f"{r.tokens_per_s:>10.1f} {r.speedup:>7.2f}x"
        )


if __name__ == "__main__":
    main()
