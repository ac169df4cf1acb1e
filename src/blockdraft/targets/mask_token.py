"""The mask token a pipeline chose, carried from stage to stage.

Why: a target without a mask token (most instruct models) needs one named once, at
`blockdraft rollout --mask-token`. The rollouts' manifest and the drafter checkpoint
record it, and every later stage takes it from there, so no stage has to be told again
and no two stages can silently use different ones. An explicit `--mask-token` that
differs from a recorded one, or two records that differ, is a one-line error naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockdraft.errors import BlockdraftError
from blockdraft.targets.hf_target import token_id
from blockdraft.targets.registry import load_target
from blockdraft.targets.target import Target


class MaskTokenError(BlockdraftError, ValueError):
    """Two stages of one pipeline name different mask tokens."""


@dataclass(frozen=True)
class RecordedMask:
    """A mask token some artifact was made with: a token string or an id."""

    source: str  # what recorded it, for messages ("rollouts in runs/r", "drafter runs/d")
    token: str | int


def mask_token_text(target: Target) -> str | None:
    """The mask token of a loaded target as text; None for an id past the tokenizer (a spare
    embedding row that no text maps to)."""
    if target.mask_token_id >= len(target.tokenizer):
        return None
    token = target.tokenizer.convert_ids_to_tokens(target.mask_token_id)
    return token if isinstance(token, str) else None


def _describe(token: str | int, mask_id: int) -> str:
    return f"id {mask_id}" if isinstance(token, int) else f"{token!r} (id {mask_id})"


def check_mask_tokens(
    target: Target, explicit: str | int | None, recorded: list[RecordedMask]
) -> None:
    """Every recorded mask token, and an explicit one, name the target's mask id."""
    named = []
    if explicit is not None:
        named.append(("--mask-token", explicit))
    named += [(r.source, r.token) for r in recorded]
    if len(named) < 2:
        return
    tokenizer, vocab = target.tokenizer, target.vocab_size
    ids = [(source, token, token_id(tokenizer, token, vocab)) for source, token in named]
    for source, token, mask_id in ids[1:]:
        first_source, first_token, first_id = ids[0]
        if mask_id != first_id:
            raise MaskTokenError(
                f"mask token {_describe(first_token, first_id)} from {first_source} differs from "
                f"{_describe(token, mask_id)} recorded by {source}; a pipeline uses one mask "
                "token (drop --mask-token to use the recorded one)"
            )


def load_target_with_mask(
    name_or_path: str,
    *,
    mask_token: str | int | None = None,
    recorded: list[RecordedMask] | None = None,
    loader: Callable[..., Target] = load_target,
    **kwargs: Any,
) -> Target:
    """`loader` (`load_target`) with the mask token named explicitly, else the one the
    artifacts the caller reads were made with, else the target's own; refuses a pipeline
    that names two."""
    recorded = list(recorded or [])
    chosen = mask_token if mask_token is not None else (recorded[0].token if recorded else None)
    try:
        target = loader(name_or_path, mask_token=chosen, **kwargs)
    except ValueError as exc:
        if "mask token" not in str(exc):
            raise
        if chosen is None:  # the target has none: the message says to pass one
            raise MaskTokenError(str(exc)) from None
        where = "--mask-token" if mask_token is not None else recorded[0].source
        raise MaskTokenError(f"{exc} (named by {where})") from None
    try:
        check_mask_tokens(target, mask_token, recorded)
    except ValueError as exc:  # a recorded token the tokenizer lacks
        raise MaskTokenError(str(exc)) from None
    return target
