"""`blockdraft rollout`: sample target responses to a prompt source into a rollout directory.

Re-running the same command after an interruption resumes it. Under torchrun (also
several nodes with a shared --out) each rank generates its share of the shards into the
same directory; the set equals a one-process run (`blockdraft.data.rollouts.distributed`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from blockdraft.cli.arguments import (
    SAMPLING_FLAGS,
    add_sampling_args,
    nonnegative_int,
    positive_int,
    top_k_or_minus_one,
    user_error,
)
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.prompt_type import PromptError
from blockdraft.data.rollouts.distributed import init_from_env
from blockdraft.data.rollouts.engine import engine_rows
from blockdraft.data.rollouts.generate import generate_rollouts, stored_topk
from blockdraft.data.rollouts.importer import import_rollouts
from blockdraft.data.rollouts.store import RolloutError, read_manifest
from blockdraft.devices import add_device_args, resolve_dtype
from blockdraft.engines.registry import engine_names
from blockdraft.errors import UserError
from blockdraft.sampling import MAX_NEW_TOKENS, SamplingSettings
from blockdraft.targets.mask_token import MaskTokenError
from blockdraft.targets.registry import load_target, model_directory
from blockdraft.threads import add_threads_arg, configure_cpu

EXAMPLE = """examples:
  blockdraft rollout --target tiny --prompts stdlib:train --out rollouts/tiny-greedy \\
      --temperature 0
  blockdraft rollout --target Qwen/Qwen3-4B --prompts examples/prompts.jsonl:prompt \\
      --out rollouts/train --temperature 0 --max-new-tokens 1024 --batch-size 32
"""
IMPORT_EXAMPLE = """example:
  blockdraft rollout-import vllm-responses.jsonl --target Qwen/Qwen3-4B \\
      --out rollouts/imported --temperature 0
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout",
        help="generate target rollouts (resumable, sharded)",
        description="Generate one target response per prompt and store token ids, the "
        "log-prob of each sampled token and optionally the top-k distribution.",
        epilog=EXAMPLE,
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="prompt spec: path.jsonl[:field], stdlib:train, stdlib:eval, humaneval, "
        "hf:name[:config]:split:field",
    )
    p.add_argument("--out", required=True, help="rollout directory (created; resumed if it exists)")
    add_sampling_args(
        p,
        {
            "temperature": "sampling temperature, 0 = greedy (default 1.0)",
            "top_p": "nucleus sampling cutoff in (0, 1] (default 1.0 = off)",
            "top_k": "top-k cutoff (default 0 = off)",
            "max_new_tokens": f"longest response in tokens (default {MAX_NEW_TOKENS})",
            "seed": "sampling seed (default 0)",
        },
        dataclasses.asdict(SamplingSettings()),
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="prompts generated together (default 8)"
    )
    p.add_argument("--shard-size", type=positive_int, default=64, help="rollouts per shard file")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--store-topk",
        type=nonnegative_int,
        default=None,
        help="also store the top N entries of each response token's sampling distribution "
        "(soft targets; with --top-k <= N the whole distribution, so sampling E2E/EDR "
        "fine-tunes need no target run). Default: the --top-k when sampling with a top-k "
        f"of at most {AUTO_STORE_TOPK}, else 0 (resuming: what the set was written with)",
    )
    p.add_argument(
        "--no-logprobs",
        action="store_true",
        help="greedy only, without --store-topk: store no log-probs (NaN), so the greedy "
        "choice needs no full softmax; on a CPU it then takes the exact argmax through an "
        "int8 screen of a large LM head (about 2x the tokens/s on Gemma 3 at batch 32). "
        "Such rollouts can be scored and trained greedily only",
    )
    p.add_argument(
        "--engine",
        choices=["blockdraft", *engine_names()],
        default="blockdraft",
        help="what generates the rows: blockdraft's own loop (default) or a serving engine "
        "(vllm: installed with `make engine`; several times the tokens/s at larger "
        "batches, the same tokens at temperature 0, the same shards and manifest)",
    )
    _target_args(p)
    p.set_defaults(func=run)
    _register_import(subparsers)


def _target_args(p: argparse.ArgumentParser) -> None:
    add_target_options(p)
    add_device_args(p, "the target")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_arg(p)


def _register_import(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout-import",
        help="turn responses generated by a serving engine (JSONL) into a rollout set",
        description="Read responses produced elsewhere (vLLM, SGLang, TGI, any "
        "OpenAI-compatible server; text or token ids), tokenize them with the target's "
        "tokenizer, recompute the target's log-probs under the stated sampling settings in "
        "one teacher-forced pass, and write the shards + manifest `blockdraft rollout` "
        "writes. Responses that cannot be rollouts of this target are dropped and counted. "
        "Recipe: docs/rollouts.md.",
        epilog=IMPORT_EXAMPLE,
    )
    p.add_argument("file", help="JSONL file, one response per line (formats: docs/rollouts.md)")
    p.add_argument("--out", required=True, help="rollout directory (created; resumed if it exists)")
    p.add_argument(
        "--prompts",
        default=None,
        help="prompt spec to join by id, for records that carry no prompt (e.g. OpenAI batch "
        "output lines, joined on custom_id)",
    )
    add_sampling_args(
        p,
        {
            "temperature": "as sampled (0 = greedy)",
            "top_p": "as sampled: the nucleus cutoff in (0, 1]",
            "top_k": "0 or -1 = no top-k filter",
            "max_new_tokens": "default: as stated, else the longest",
            "seed": "recorded only",
        },
        top_k=top_k_or_minus_one,
    )
    p.add_argument(
        "--store-topk", type=nonnegative_int, default=0, help="also store the top-N distribution"
    )
    p.add_argument("--shard-size", type=positive_int, default=64, help="rollouts per shard file")
    p.add_argument(
        "--batch-tokens",
        type=positive_int,
        default=8192,
        help="padded tokens per teacher-forced batch",
    )
    p.add_argument(
        "--eos",
        choices=["auto", "never"],
        default="auto",
        help="auto: append the end-of-sequence token when the engine says it stopped on one "
        "but left it out of the response",
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, help="import only the first N responses"
    )
    _target_args(p)
    p.set_defaults(func=run_import)


def _load(args: argparse.Namespace, device: Any) -> Any:
    """The target; a bad name or path is a one-line UserError (the CLI handler prints it)."""
    try:
        return load_target_from_args(
            args,
            rollouts=[args.out] if read_manifest(Path(args.out)) is not None else [],
            loader=load_target,
            device=device,
            dtype=resolve_dtype(args.dtype, device),
            progress=not args.no_progress,
        )
    except MaskTokenError:
        raise
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load target {args.target!r}: {exc}") from None


def run_import(args: argparse.Namespace) -> int:
    configure_cpu(args.threads, args.device)
    overrides = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if "top_k" in overrides:
        overrides["top_k"] = max(0, overrides["top_k"])  # -1: off, as engines write it
    try:
        prompts = (
            load_prompts(args.prompts, allow_download=getattr(args, "allow_download", False))
            if args.prompts
            else None
        )
        _, device, _ = init_from_env(args.device)
    except (PromptError, RuntimeError, ValueError) as exc:
        return user_error(exc)
    target = _load(args, device)  # a bad target is one line from the CLI's handler
    try:
        report = import_rollouts(
            target,
            args.file,
            args.out,
            overrides,
            prompts=prompts,
            store_topk=args.store_topk,
            shard_size=args.shard_size,
            batch_tokens=args.batch_tokens,
            eos=args.eos,
            limit=args.limit,
            progress=not args.no_progress,
        )
    except (PromptError, RolloutError, ValueError) as exc:
        return user_error(exc)
    print(report.summary())
    return 0


def _note_stored_topk(requested: int, settings: SamplingSettings, target: Any) -> None:
    """Say when fewer entries than --store-topk are stored (the manifest records those)."""
    stored = stored_topk(requested, settings, target.vocab_size)
    if stored == requested:
        return
    why = (
        f"under --top-k {settings.top_k} at most {stored} entries of each distribution are non-zero"
        if stored == settings.top_k and not settings.greedy
        else f"the vocabulary of {target.name!r} has {stored} tokens"
    )
    print(f"note: --store-topk {requested}: {why}; storing {stored}", file=sys.stderr)


# the largest top-k cutoff whose whole distribution is stored by default (8 bytes per entry
# per response token)
AUTO_STORE_TOPK = 64


def auto_store_topk(settings: SamplingSettings, no_logprobs: bool) -> int:
    """`--store-topk`'s default: a sampled rollout under a top-k cutoff of at most
    `AUTO_STORE_TOPK` stores its top k, which is then its whole sampling distribution.
    Why: sampling E2E and EDR fine-tunes compare with it, and read from the rollouts it
    needs no target logits (docs/results.md, section 6)."""
    if no_logprobs or settings.greedy or not 0 < int(settings.top_k or 0) <= AUTO_STORE_TOPK:
        return 0
    return int(settings.top_k)


def run(args: argparse.Namespace) -> int:
    configure_cpu(args.threads, args.device)
    try:
        settings = SamplingSettings(**{k: getattr(args, k) for k in SAMPLING_FLAGS})
        if args.store_topk is None:  # resuming: what the set was written with
            written = read_manifest(Path(args.out))
            args.store_topk = (
                int(written.get("store_topk") or 0)
                if written is not None
                else auto_store_topk(settings, args.no_logprobs)
            )
        if args.no_logprobs and (not settings.greedy or args.store_topk):
            raise ValueError(
                "--no-logprobs: only greedy rollouts (--temperature 0) without --store-topk "
                "can leave out log-probs"
            )
        prompts = load_prompts(args.prompts, limit=args.limit, allow_download=args.allow_download)
        ctx, device, created = init_from_env(args.device)
    except (PromptError, RuntimeError, ValueError) as exc:
        return user_error(exc)
    try:
        return _generate(args, settings, prompts, ctx, device)
    finally:
        if created:
            dist.destroy_process_group()


def _generate(args: argparse.Namespace, settings: Any, prompts: Any, ctx: Any, device: Any) -> int:
    if args.engine != "blockdraft" and ctx.distributed:
        raise UserError(
            f"--engine {args.engine} runs in one process (the engine parallelises itself); "
            "start it without torchrun"
        )
    target = _load(args, device)  # a bad target is one line from the CLI's handler
    if ctx.rank == 0:
        _note_stored_topk(args.store_topk, settings, target)
    rows = engine_rows(
        args.engine,
        model_directory(target),
        settings,
        target.stop_token_ids,
        dtype=str(target.dtype).removeprefix("torch."),
        max_model_len=target.context_length or settings.max_new_tokens + 4096,
    )
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
            store_logprobs=not args.no_logprobs,
            row_generator=rows,
            engine_name=rows.name if rows is not None else None,
        )
    except (PromptError, RolloutError) as exc:
        return user_error(exc)
    finally:
        if rows is not None:
            rows.close()
    if ctx.rank != 0:
        return 0
    m = rollouts.manifest
    print(
        f"{len(rollouts)} rollouts, {m['num_response_tokens']} response tokens in "
        f"{len(m['shards'])} shard(s) -> {args.out}"
    )
    return 0
