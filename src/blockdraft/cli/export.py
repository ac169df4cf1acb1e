"""`blockdraft export CKPT --out DIR`: validate a drafter and write the serving-engine format.

The output directory loads in SGLang (`--speculative-algorithm DFLASH
--speculative-draft-model-path DIR`) and vLLM (`method: dflash`) without conversion; see
docs/export.md for what is checked and against which loader sources. `--format gguf` also
writes DIR/drafter.gguf and the target as a GGUF for llama.cpp (`llama-server -md`),
after saying up front whether llama.cpp can serve the pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from blockdraft.cli.arguments import user_error
from blockdraft.cli.drafter_options import drafter_spec
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.engines.interface import EngineError
from blockdraft.engines.registry import export_formats, serve_commands
from blockdraft.serialization.checkpoint import NAMESPACE, read_config, verify_weights
from blockdraft.serialization.drafter_spec import checkpoint_of
from blockdraft.serialization.export import (
    ExportError,
    export_config,
    export_drafter,
    validate_for_serving,
)
from blockdraft.targets.registry import list_targets, model_directory

_DTYPES = ("float32", "bfloat16", "float16")
EXAMPLE = """examples:
  blockdraft export runs/edr --out drafters/my-dflash --dtype bfloat16
  blockdraft export runs/edr --check          # validate only, write nothing
  blockdraft export hybrid:conf=0.3:runs/edr --out drafters/hybrid   # with lookup fallback
  blockdraft export trim:conf=0.3:runs/edr --out drafters/trimmed     # its confident prefix
  blockdraft export runs/edr --out drafters/gguf --format gguf --target smollm2-135m
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="validate a drafter checkpoint and write the DFlash serving format",
        description=__doc__,
        epilog=EXAMPLE,
    )
    p.add_argument(
        "ckpt",
        type=drafter_spec,
        help="drafter checkpoint directory, or a run directory (its final/ is used); "
        "hybrid[:conf=C]:PATH exports PATH with its prompt-lookup fallback, trim[:conf=C]:PATH "
        "proposing only the slots before the first below confidence C (both served by "
        "blockdraft's vLLM plugin only)",
    )
    p.add_argument("--out", help="output directory (required unless --check)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="cast weights (default: keep)")
    add_target_options(p, required=False)  # needed for a reduced draft vocab; names the mask
    p.add_argument("--check", action="store_true", help="only validate CKPT, write nothing")
    p.add_argument(
        "--format",
        choices=("safetensors", *export_formats()),
        default="safetensors",
        help="gguf: also the drafter and target as llama.cpp GGUFs (needs --target and "
        "`make engine-llamacpp`; --dtype picks f32/bf16/f16, default f32)",
    )
    p.add_argument(
        "--expand-vocab",
        action="store_true",
        help="a reduced draft vocabulary: write the drafter over the target's whole "
        "vocabulary (llama.cpp and z-lab's DFlash2 format load no d2t); score the export "
        "to see what changed",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous export in --out (never a run, rollout set or checkpoint)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = args.ckpt
    if spec.kind == "ngram":
        return user_error("prompt lookup has no weights to export")
    ckpt = checkpoint_of(spec)
    hybrid_conf = spec.min_confidence if spec.kind == "hybrid" else None
    trim_conf = spec.min_confidence if spec.kind == "trim" else None
    if args.check:
        verify_weights(ckpt)
        problems = validate_for_serving(ckpt)
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        print(f"{ckpt}: {'servable' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if not args.out:
        return user_error("--out DIR is required (or pass --check)")
    target = None
    if args.target:
        target = load_target_from_args(args, drafters=[ckpt])
    engine_format, checked = export_formats().get(args.format), None
    if engine_format is not None:
        try:  # on the config.json the export will have, before anything is written
            cfg = export_config(ckpt, hybrid_conf, args.expand_vocab, trim_conf)
            checked = engine_format.check(cfg, target)
        except (EngineError, ExportError) as exc:
            return user_error(exc)
    try:
        out = export_drafter(
            ckpt,
            args.out,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            target=target,
            overwrite=args.overwrite,
            expand_vocab=args.expand_vocab,
            hybrid_conf=hybrid_conf,
            trim_conf=trim_conf,
        )
    except ValueError as exc:  # not servable (or another user error): one line, status 2
        return user_error(exc)
    print(f"exported {ckpt} -> {out} (validated for SGLang / vLLM / z-lab dflash)")
    print("serve it (target first, then the drafter):")
    config = target.model.config if target is not None else None
    print(serve_commands(out, _target_path(out, target), config))
    if engine_format is not None:
        try:
            command = engine_format.write(out, checked, args.dtype or "float32", log=print)
        except EngineError as exc:
            return user_error(exc)
        print(f"# {args.format} files in {out}\n{command}")
    return 0


def _target_path(out: Any, target: Any) -> str | None:
    """What an engine loads the target from.

    A named target is given by its folder (`vllm serve tiny` loads nothing); without
    --target the checkpoint's recorded target name is used, resolved the same way. A
    local folder is named by its absolute path (the engine may start elsewhere); a
    recorded path that is not a folder from here gives None (`TARGET` is printed)."""
    cfg = read_config(out)
    name = (
        target.name
        if target is not None
        else (((cfg.get(NAMESPACE) or {}).get("drafter_config") or {}).get("target_name"))
    )
    folder = model_directory(target) if target is not None else None
    if folder:
        return str(Path(folder).resolve())
    if not name:
        return None
    named = {t["name"]: t["path"] for t in list_targets()}
    where = Path(named.get(name, name)).expanduser()
    if where.is_dir():
        return str(where.resolve())
    if name.startswith((".", "/", "~")) or name in named:  # a folder not found from here
        return None
    return name  # a hub id: the engines resolve it themselves
