"""`blockdraft rollout`: sample target responses to a prompt source into a rollout directory.

Re-running the same command after an interruption resumes it (see
`blockdraft.data.rollouts`); the target is loaded by name through the model registry.
Under torchrun (`torchrun --nproc_per_node N -m blockdraft rollout ...`, also several
nodes with a shared --out) each rank generates its share of the shards into the same
directory; the set equals a one-process run (`blockdraft.data.distributed_rollouts`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from blockdraft.threads import add_threads_arg, apply_threads


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout",
        help="generate target rollouts (resumable, sharded)",
        description="Generate one target response per prompt and store token ids, the "
        "log-prob of each sampled token and optionally the top-k distribution.",
    )
    p.add_argument(
        "--target", required=True, help="target name (tiny, gemma-3-270m) or HF model path"
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="prompt spec: path.jsonl[:field], stdlib:train, stdlib:eval, humaneval, "
        "hf:name[:config]:split:field",
    )
    p.add_argument("--out", required=True, help="rollout directory (created; resumed if it exists)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-size", type=int, default=64, help="rollouts per shard file")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--store-topk",
        type=int,
        default=0,
        help="also store the target's top-N distribution per response token",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device of the target: auto (this rank's GPU if there is one, else cpu), cpu, "
        "cuda, cuda:N",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--mask-token", default=None, help="mask token for targets without one")
    p.add_argument("--allow-download", action="store_true", help="allow hub downloads")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    from blockdraft.data.generation import SamplingSettings
    from blockdraft.data.prompts import PromptError, load_prompts

    try:
        settings = SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        prompts = load_prompts(args.prompts, limit=args.limit)
    except (PromptError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from blockdraft.data.distributed_rollouts import init_from_env

    try:
        ctx, device, created = init_from_env(args.device)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _generate(args, settings, prompts, ctx, device)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _generate(args: argparse.Namespace, settings: Any, prompts: Any, ctx: Any, device: Any) -> int:
    import torch

    from blockdraft.data.prompts import PromptError
    from blockdraft.data.rollouts import RolloutError, generate_rollouts
    from blockdraft.models.registry import load_target

    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    try:
        target = load_target(
            args.target,
            device=device,
            dtype=getattr(torch, dtype),
            mask_token=args.mask_token,
            allow_download=args.allow_download,
            trust_remote_code=args.trust_remote_code,
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as exc:
        print(f"error: cannot load target {args.target!r}: {exc}", file=sys.stderr)
        return 2
    try:
        rollouts = generate_rollouts(
            target,
            prompts,
            args.out,
            settings,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            store_topk=args.store_topk,
            progress=not args.no_progress,
            prompt_spec=args.prompts,
        )
    except (PromptError, RolloutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ctx.rank != 0:
        return 0
    m = rollouts.manifest
    print(
        f"{len(rollouts)} rollouts, {m['num_response_tokens']} response tokens in "
        f"{len(m['shards'])} shard(s) -> {args.out}"
    )
    return 0
