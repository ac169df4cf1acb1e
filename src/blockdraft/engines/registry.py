"""The engines blockdraft can run, by name, and how to serve an export in each.

Why a table: `rollout --engine`, `serve-check --engine` and `export`'s printed commands
list what is registered here, so an engine module plus one `register_engine` line is
all a new engine needs (docs/architecture.md, "Adding an engine").
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from blockdraft.engines.interface import Engine, EngineError, EngineFormat
from blockdraft.engines.llamacpp_engine import LLAMACPP
from blockdraft.engines.vllm_engine import VLLM
from blockdraft.serialization.checkpoint import read_config
from blockdraft.serialization.export import dflash_field
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE

ENGINES: dict[str, Engine] = {}


def register_engine(engine: Engine) -> Engine:
    """Make `engine` available under `engine.name` (a later one of that name replaces it)."""
    ENGINES[engine.name] = engine
    return engine


register_engine(VLLM)
register_engine(LLAMACPP)
DEFAULT_ENGINE = VLLM.name  # what serve-check runs unless told otherwise


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def get_engine(name: str) -> Engine:
    """The registered engine `name`, or one `EngineError` line listing those there are."""
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    return ENGINES[name]


def export_formats() -> dict[str, EngineFormat]:
    """The engine file formats `export --format` can write beside the DFlash folder."""
    return {e.export_format.name: e.export_format for e in ENGINES.values() if e.export_format}


def serve_commands(
    out_dir: str | Path, target_path: str | None = None, target_config: Any = None
) -> str:
    """How to serve an exported drafter with SGLang and each registered engine (printed
    after export).

    `target_path` is what the engine loads the target from (a named target's folder, a
    local model folder or a hub id; None prints `TARGET`); with the target's HF config,
    an engine that cannot serve the pair says why instead of its command. The drafter is
    named by its absolute path and every argument is shell-quoted, so the commands work
    from any directory and any path."""
    cfg = read_config(out_dir)
    drafter = str(Path(out_dir).resolve())
    name = shlex.quote(target_path) if target_path else "TARGET"
    k = int(dflash_field(cfg, "block_size") or 16) - 1
    lines = [
        f"# SGLang\npython -m sglang.launch_server --model-path {name} \\\n"
        f"    --speculative-algorithm DFLASH --speculative-draft-model-path "
        f"{shlex.quote(drafter)}"
        if cfg.get("architectures") != [LOOKUP_ARCHITECTURE]
        else "# SGLang: not servable: a lookup-aware drafter needs blockdraft's vLLM plugin"
    ]
    for engine in ENGINES.values():
        problem = None if target_config is None else engine.serve_problem(cfg, target_config)
        lines.append(
            f"# {engine.name}: not servable here: {problem}"
            if problem
            else f"# {engine.name}\n{engine.serve_command(name, drafter, k)}"
        )
    lines.append(f"# transformers\nAutoModel.from_pretrained({drafter!r}, trust_remote_code=True)")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "engine_names",
    "export_formats",
    "get_engine",
    "register_engine",
    "serve_commands",
]
