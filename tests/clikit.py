"""Helpers for CLI tests: a random target saved as a local HF model, rollouts, a drafter.

The CLI loads targets by name or path, so CLI tests need a model on disk: a small random
Qwen3 (`tests/random_targets.py`) saved with `save_pretrained`, loaded back through
the registry like any user model.
"""

from __future__ import annotations

from pathlib import Path

from blockdraft.cli import main
from blockdraft.data.prompt_type import Prompt
from blockdraft.data.rollouts import SamplingSettings, generate_rollouts


def save_local_model(path: Path, seed: int = 0) -> Path:
    from random_targets import make_random_target

    target = make_random_target("qwen3", num_layers=4, seed=seed)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def prompts(n: int, prefix: str = "p") -> list[Prompt]:
    texts = ["def add(a, b):", "for i in range(3):", "import os", "class Point:"]
    return [Prompt(f"{prefix}{i}", f"# {i}\n{texts[i % 4]}", None, "test") for i in range(n)]


def make_rollouts(target, out: Path, n: int = 6, shard_size: int = 2, tokens: int = 8) -> Path:
    generate_rollouts(
        target,
        prompts(n),
        out,
        SamplingSettings(temperature=0.0, max_new_tokens=tokens, seed=0),
        shard_size=shard_size,
        batch_size=n,
        progress=False,
    )
    return out


def save_random_drafter(target, path: Path, block_size: int = 4, **extra) -> Path:
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.serialization.checkpoint import save_drafter

    drafter = BlockDrafter(DrafterConfig.for_target(target, block_size=block_size))
    return save_drafter(drafter.bind_target(target), path, extra or None)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `blockdraft argv...` run in-process."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    """The `error:` line of stderr; fails if there is a traceback or no such line."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]
