"""The `Engine` interface: what blockdraft asks of a serving engine it runs.

Why one interface: engine rollouts (`rollout --engine`), `serve-check`, the demo's served
row and `export`'s printed commands all need the same few things of an engine (start it
on a target folder, optionally with an exported drafter; generate rows from token ids;
read its drafting counters per request; say before starting why it cannot serve a pair),
so a new engine is one module implementing `Engine` plus one `register_engine` call
(`engines/registry.py`), and nothing above this package names an engine's own API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import torch

from blockdraft.errors import BlockdraftError
from blockdraft.sampling import SamplingSettings

Drafts = list[tuple[list[int], list[list[int]]]]  # (anchor ids, proposed ids) per drafting step


class EngineError(BlockdraftError):
    """An engine that is missing, fails to start, or is asked for what it cannot do."""


@dataclass(frozen=True)
class Speculation:
    """How a started engine drafts: `method` "dflash" (an exported drafter in `model`),
    "ngram" (prompt lookup, `lookup_min..lookup_max` tokens) or "suffix" (suffix decoding
    with the settings in `suffix`); `sampled`: at T > 0 draw the
    drafter's tokens from its distribution and verify with min(1, p/q), as the evaluator
    scores, rather than accept its argmax with probability p(argmax)."""

    method: str
    num_proposals: int
    model: str | None = None
    sampled: bool = False
    lookup_min: int = 1
    lookup_max: int = 3
    suffix: Any = None  # "suffix": a `drafters.suffix.SuffixConfig` (its own tree, no global one)


@dataclass
class SpecCounters:
    """Speculative-decoding counters: drafts (rounds that proposed tokens), proposed and
    accepted tokens, and accepted tokens by draft position (1-based in docs, 0 here)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def minus(self, before: SpecCounters) -> SpecCounters:
        """What happened between `before` and this reading."""
        per = [
            a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
            for i, a in enumerate(self.accepted_per_position)
        ]
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            per,
        )

    @property
    def mean_acceptance_length(self) -> float:
        """The engines' own figure: 1 + accepted / drafts (tokens a drafting round yields)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")


@dataclass
class EngineOutput:
    """One generated row: response ids, each token's log-prob (NaN where not asked for)
    and, when asked for, the top-k ids and log-probs of each step's distribution."""

    response_ids: list[int]
    logprobs: list[float]
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


class ClosedOnExit:
    """`with engine:` closes it on the way out (the context-manager half of every
    `RunningEngine`); the engine's own `close` gives its memory back."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunningEngine(Protocol):
    """A started engine over one target (and drafter); closed to give its memory back.

    `generate`: one row per token-id prompt, as one batch; `seeds[i]` seeds prompt i's
    sampling; `logprobs` None for none, 0 for the sampled token's, k for the top k (`topk`
    of them kept per step). `counters`: the drafting counters since the start.
    `take_drafts`: every drafting step since the last call (`record_drafts=True`), also
    those that proposed nothing: how `serve-check` counts lookup rounds and compares
    `--rounds`."""

    version: str  # the engine's own version, recorded in manifests and reports

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        stop_token_ids: Sequence[int],
        seeds: Sequence[int | None],
        *,
        logprobs: int | None = None,
        topk: int = 0,
    ) -> list[EngineOutput]: ...
    def counters(self) -> SpecCounters: ...
    def take_drafts(self) -> Drafts: ...
    def close(self) -> None: ...
    def __enter__(self) -> RunningEngine: ...
    def __exit__(self, *exc: object) -> None: ...


class EngineFormat(Protocol):
    """An engine's own file format beside the DFlash folder (`export --format NAME`).

    `check` runs before anything is written, on the config.json the export will have:
    the one-line `EngineError` why the engine cannot serve the pair, else what `write`
    needs; `write` adds the engine's files to an export folder and returns the shell
    command that serves them."""

    name: str  # what `export --format` takes

    def check(self, drafter_cfg: dict[str, Any], target: Any) -> Any: ...
    def write(self, export_dir: str | Path, checked: Any, dtype: str, log: Any) -> str: ...


class Engine(Protocol):
    """A kind of serving engine. `version()`: None when it is not installed.
    `serve_problem`: why it cannot serve an exported drafter (its config.json) for a
    target (its HF config) here, or None: said before minutes of loading. `serve_command`:
    the shell command serving the target with the drafter (arguments already quoted).
    `load` starts it on a local model folder; `sampled_logprobs`: log-probs under the
    distribution tokens were drawn from, else the T = 1 log-softmax (greedy rollouts)."""

    name: str  # what `--engine` takes
    # `take_drafts` also returns prompt lookup's steps that proposed nothing (an engine
    # that logs only verified drafts counts lookup rounds from its counters instead)
    records_lookup_steps: bool
    # its `ngram`/`suffix` ways run blockdraft's lookup rules, so serve-check compares their
    # rounds with the evaluator's; else they are the engine's own rules, reported only
    lookup_rules_match: bool
    # the files `export --format` writes for it; None: it loads the exported DFlash folder
    export_format: EngineFormat | None

    def version(self) -> str | None: ...
    def serve_problem(self, drafter_cfg: dict[str, Any], target_config: Any) -> str | None: ...
    def serve_command(self, target: str, drafter_dir: str, num_proposals: int) -> str: ...
    def load(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        speculation: Speculation | None = None,
        sampled_logprobs: bool = False,
        record_drafts: bool = False,
    ) -> RunningEngine: ...


__all__ = [
    "ClosedOnExit",
    "Drafts",
    "Engine",
    "EngineError",
    "EngineFormat",
    "EngineOutput",
    "RunningEngine",
    "SpecCounters",
    "Speculation",
]
