"""The target options every sub-command that loads a target takes, and the one way to load it.

Why one place: the flags mean the same everywhere, and a mask token named once (at
`blockdraft rollout`) is recorded with the rollouts and the drafter: `load_target_from_args`
takes it from the artifacts a command reads, and refuses a `--mask-token` that differs.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from blockdraft.data.mask_records import recorded_masks
from blockdraft.targets.mask_token import load_target_with_mask
from blockdraft.targets.target import Target

TARGET_HELP = "target name (tiny, gemma-3-270m, smollm2-135m) or HF model id / local path"
MASK_TOKEN_HELP = (
    "mask token for a target without one (a token of its vocabulary that text never uses, "
    "or an id); recorded with the rollouts and the drafter, so later stages need not repeat it"
)
# the options `add_target_options` adds besides the target itself (tests walk the parsers)
TARGET_OPTIONS = ("--mask-token", "--allow-download", "--trust-remote-code")


def add_target_options(
    p: argparse.ArgumentParser, *, required: bool = True, positional: bool = False
) -> None:
    """`--target` (or a positional NAME) plus `TARGET_OPTIONS`."""
    if positional:
        p.add_argument("name", help=TARGET_HELP)
    else:
        p.add_argument("--target", required=required, default=None, help=TARGET_HELP)
    p.add_argument("--mask-token", default=None, help=MASK_TOKEN_HELP)
    p.add_argument("--allow-download", action="store_true", help="allow hub downloads")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run the model repository's own code"
    )


def load_target_from_args(
    args: argparse.Namespace,
    *,
    rollouts: Iterable[str | Path] = (),
    drafters: Iterable[str | Path] = (),
    **kwargs: Any,
) -> Target:
    """The target the target options name, with the mask token of the artifacts it reads
    (`loader=`: the `load_target` a command module uses)."""
    name = getattr(args, "target", None) or getattr(args, "name", None)
    return load_target_with_mask(
        name,
        mask_token=args.mask_token,
        recorded=recorded_masks(rollouts, drafters),
        allow_download=args.allow_download,
        trust_remote_code=args.trust_remote_code,
        **kwargs,
    )
