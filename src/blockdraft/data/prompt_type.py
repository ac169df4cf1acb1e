"""One prompt, the error a prompt source raises, and the hash splits built-in sources share.

Its own module so that the sources (`prompt_specs` for files and mixes, `stdlib_prompts`,
`pydoc_prompts`, `sharegpt_prompts`) all build on it without importing each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from blockdraft.errors import BlockdraftError


class PromptError(BlockdraftError, ValueError):
    """A prompt source could not be read; the message names the file/line or spec."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain `text` or chat `messages` (exactly one is set)."""

    id: str
    text: str | None
    messages: list[dict] | None
    source: str

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise PromptError(f"prompt {self.id!r}: set exactly one of text / messages")


def hash_fraction(key: str) -> float:
    """A stable point in [0, 1) for `key` (SHA-256): the sources' splits and orders."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def check_split(source: str, split: str) -> None:
    """A built-in source has a `train` and an `eval` split, nothing else."""
    if split not in ("train", "eval"):
        raise PromptError(f"unknown {source} split {split!r}: use {source}:train or {source}:eval")
