"""One prompt and the error a prompt source raises: the type every prompt source returns.

Its own module so that the sources (`prompt_specs` for files and mixes, `stdlib_prompts`,
`pydoc_prompts`) all build on it without importing each other.
"""

from __future__ import annotations

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
