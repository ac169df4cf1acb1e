"""`blockdraft target build|info|sample NAME`: build, inspect and try out targets.

`build tiny` trains the embedded target from source into the cache (minutes) and says
whether it equals the weights the package ships; `build gemma-3-270m` (and
`build smollm2-135m`) converts the GGUF once. `sample` is the quickest way to see that a
target produces sensible text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from blockdraft.cli.arguments import add_sampling_args, positive_int, seed_int, user_error
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.data.prompt_specs import check_fits_context
from blockdraft.errors import BlockdraftError
from blockdraft.sampling import MAX_NEW_TOKENS
from blockdraft.targets import gemma, registry, smollm2, tiny
from blockdraft.targets.fingerprint import target_fingerprint
from blockdraft.targets.registry import list_targets

EXAMPLES = {
    "target": "  blockdraft target list\n  blockdraft target sample tiny --prompt 'def add('",
    "build": "  blockdraft target build tiny\n  blockdraft target build gemma-3-270m",
    "info": "  blockdraft target info tiny\n  blockdraft target info Qwen/Qwen3-4B",
    "sample": "  blockdraft target sample tiny --prompt 'import os' --max-new-tokens 32\n"
    "  blockdraft target sample smollm2-135m --prompt 'What is 2 + 3?' --chat",
    "list": "  blockdraft target list",
}


def _epilog(name: str) -> str:
    return f"examples:\n{EXAMPLES[name]}\n"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "target", help="build, inspect and sample targets", epilog=_epilog("target")
    )
    sub = parser.add_subparsers(dest="target_command", required=True)

    build = sub.add_parser(
        "build", help="build/convert a named target into the cache", epilog=_epilog("build")
    )
    build.add_argument("name", help="tiny | gemma-3-270m | smollm2-135m")
    build.add_argument(
        "--seed", type=seed_int, default=None, help="seed of the tiny build (default 0)"
    )
    build.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads of the tiny build (default: the idle cores); the count changes "
        "the weights' last bits, the shipped weights were built with the one in their manifest",
    )
    build.set_defaults(func=_build)

    info = sub.add_parser(
        "info",
        help="show a target's shapes, tokens, fingerprint and manifest",
        epilog=_epilog("info"),
    )
    add_target_options(info, positional=True)
    info.set_defaults(func=_info)

    sample = sub.add_parser("sample", help="generate text from a prompt", epilog=_epilog("sample"))
    add_target_options(sample, positional=True)
    sample.add_argument("--prompt", default="def ", help="prompt text (default 'def ')")
    add_sampling_args(
        sample,
        {
            "max_new_tokens": f"tokens to generate (default {MAX_NEW_TOKENS})",
            "temperature": "sampling temperature, 0 = greedy (default 0)",
            "seed": "sampling seed (T > 0; default 0)",
        },
        {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "seed": 0},
    )
    sample.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    sample.set_defaults(func=_sample)

    lst = sub.add_parser(
        "list", help="list named targets and whether they are ready", epilog=_epilog("list")
    )
    lst.set_defaults(func=_list)


def _build(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.name == registry.TINY:
        config = tiny.TinyConfig() if args.seed is None else tiny.TinyConfig(seed=args.seed)
        path = tiny.build_tiny_target(config, progress=True, num_threads=args.threads)
        if args.seed is None and tiny.shipped_tiny_path() is not None:
            print(_against_shipped(path))
    elif args.name == registry.GEMMA:
        path = gemma.convert_gemma(progress=True)
    elif args.name == registry.SMOLLM2:
        path = smollm2.convert_smollm2(progress=True)
    else:
        return user_error(
            f"only named targets are built ({registry.TINY}, {registry.GEMMA}, "
            f"{registry.SMOLLM2}); got {args.name!r}"
        )
    print(f"{args.name}: {path} (ready in {time.perf_counter() - t0:.1f}s)")
    print(json.dumps(_summary(tiny.read_manifest(path)), indent=2))
    return 0


def _against_shipped(path: Path) -> str:
    """How a local build of the default config compares with the shipped weights (which
    `tiny` loads): equal on a CPU like the one that built them, else the last bits."""
    ours, shipped = (load_file(p / "model.safetensors") for p in (path, tiny.SHIPPED_DIR))
    if ours.keys() != shipped.keys():
        return f"this build has other tensors than the shipped tiny weights ({tiny.SHIPPED_DIR})"
    diff = max((ours[k] - shipped[k]).abs().max().item() for k in ours)
    here, there = (_build_machine(tiny.read_manifest(p)) for p in (path, tiny.SHIPPED_DIR))
    if diff == 0:
        return f"identical to the shipped tiny weights (built with {there})"
    return (
        f"differs from the shipped tiny weights by max |diff| {diff:.3g} (this build: {here}; "
        f"shipped: {there}): the vector ISA and the thread count change the rounding "
        "(docs/results.md, 'Across CPUs'); `tiny` loads the shipped weights"
    )


def _build_machine(m: dict) -> str:
    return f"{m.get('torch_threads')} thread(s), {m.get('cpu_capability')}, {m.get('cpu_model')}"


def _summary(manifest: dict) -> dict:
    """The manifest without the long file lists (they stay on disk)."""
    if "corpus" not in manifest:
        return dict(manifest)
    corpus = manifest["corpus"]
    counts = {k: f"{len(corpus[k])} files" for k in ("train_files", "heldout_files")}
    return {**manifest, "corpus": {**corpus, **counts}}


def _info(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    target = load_target_from_args(args)
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    info = {
        "name": target.name,
        "architecture": type(target.model).__name__,
        "parameters": sum(p.numel() for p in target.model.parameters()),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "vocab_size": target.vocab_size,
        "layer_ids": target.layer_ids,
        "mask_token": [target.mask_token_id, tok.convert_ids_to_tokens(target.mask_token_id)],
        "stop_tokens": [[i, tok.convert_ids_to_tokens(i)] for i in target.stop_token_ids],
        # the template *in use* (prompt rendering, --chat); see chat_template_file below
        "has_chat_template": bool(getattr(tok, "chat_template", None)),
        "fingerprint": target_fingerprint(target),
        "load_seconds": round(load_s, 2),
    }
    path = getattr(target.model, "name_or_path", None)
    if path:
        info["path"] = str(path)
        names = ("chat_template.jinja", "chat_template.json")
        files = [f for f in names if (Path(path) / f).is_file()]
        if files and not info["has_chat_template"]:
            info["chat_template_file"] = (
                f"{files[0]} is in {path} but not used: a base model, prompts are plain text"
            )
        if tiny.is_built(path):  # a built target's manifest (any named target)
            info["manifest"] = _summary(tiny.read_manifest(path))
    print(json.dumps(info, indent=2))
    return 0


def _sample(args: argparse.Namespace) -> int:
    target = load_target_from_args(args)
    tok = target.tokenizer
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise BlockdraftError(
                f"--chat: target {args.name!r} has no chat template in use (a base model "
                "continues plain text); drop --chat"
            )
        ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tok(args.prompt)["input_ids"]
    if len(ids) == 0:  # a tokenizer without BOS gives an empty prompt no token to continue
        raise BlockdraftError(
            f"--prompt {args.prompt!r}: no tokens to continue from; give some text"
        )

    check_fits_context(["--prompt"], [list(ids)], target.context_length, args.max_new_tokens)
    print(_generate_text(target, list(ids), args.max_new_tokens, args.temperature, args.seed))
    return 0


def _generate_text(
    target, ids: list[int], max_new_tokens: int, temperature: float, seed: int
) -> str:
    """Prompt + continuation as text (HF generate, stopping at the target's stop tokens)."""
    torch.manual_seed(seed)
    input_ids = torch.tensor([ids], device=target.device)
    kwargs = (
        {"do_sample": False}
        if temperature <= 0
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    out = target.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=target.stop_token_ids,
        pad_token_id=target.tokenizer.pad_token_id,
        **kwargs,
    )
    return target.decode(out[0])


def _list(args: argparse.Namespace) -> int:
    for t in list_targets():
        state = "ready" if t["ready"] else "not built"
        print(f"{t['name']:<14} {state:<10} {t['description']}\n{'':<25}{t['path']}")
    return 0
