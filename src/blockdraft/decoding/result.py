"""What a decode returns: per-prompt traces, the run's result and its tau with a CI.

Kept apart from the loop (`loop.py`) so that readers of results (the CLI, the demo,
reports) do not need the loop's machinery, and the loop file reads top to bottom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from blockdraft.bootstrap_ci import percentile_interval, ratio_ci, resampled_sums


@dataclass
class Trace:
    """One prompt's speculative decode: output tokens and per-round accounting."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # proposals accepted per round
    emitted: list[int] = field(default_factory=list)  # tokens emitted per round (after truncation)
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, see speculative_generate


@dataclass
class DecodeResult:
    """Outputs and measurements of `decode` (tau counts only drafting rounds)."""

    outputs: list[list[int]]
    rounds_accepted: list[list[int]]
    rounds_emitted: list[list[int]]
    tau: float
    tau_ci95: tuple[float, float]
    histogram: list[int]  # histogram[j] = rounds that emitted j tokens, j = 0..K+1
    tokens_per_s: float
    ar_tokens_per_s: float | None
    speedup: float | None
    ar_outputs: list[list[int]] | None
    settings: dict[str, Any]
    # Time per phase of the speculative decodes, summed over prompts (Trace.seconds),
    # and the autoregressive baseline's split: what the cost model in docs/decoding.md uses.
    seconds: dict[str, float] = field(default_factory=dict)
    ar_stats: StepStats | None = None
    # percentile bootstrap CI of `speedup` over prompts (`speedup_and_ci`); None without
    # the AR baseline, NaNs with fewer than 2 prompts
    speedup_ci95: tuple[float, float] | None = None
    # cores other processes kept busy while this decode was timed (threads.OtherLoad),
    # and whether that left fewer cores than its threads: then no speed verdict is given
    other_load_cores: float | None = None
    machine_busy: bool = False

    @property
    def ar_step_s(self) -> float | None:
        """Mean seconds of one autoregressive step (forward + token choice)."""
        s = self.ar_stats
        return s.step_s / s.steps if s is not None and s.steps else None

    def round_costs(self) -> dict[str, float]:
        """Mean seconds per drafting round of each phase (draft, target, verify, other)."""
        n = max(self.num_rounds, 1)
        return {k: v / n for k, v in self.seconds.items() if k != "prefill"}

    @property
    def num_rounds(self) -> int:
        return sum(len(r) for r in self.rounds_emitted)

    def per_prompt_rounds(self) -> list[int]:
        return [len(r) for r in self.rounds_emitted]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["num_rounds"] = self.num_rounds
        return out


@dataclass
class StepStats:
    """Where an autoregressive decode spent its time (filled by `ar_generate`)."""

    prefill_s: float = 0.0
    steps: int = 0  # forwards after the prefill
    step_s: float = 0.0  # their total time, token choice included


def tau_and_ci(
    rounds_emitted: Sequence[Sequence[int]], seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """tau = tokens emitted by drafting rounds / drafting rounds, with a bootstrap CI.

    The CI resamples prompts (the independent units) when there are at least 8 with
    rounds; with fewer it resamples rounds, which ignores within-prompt correlation.
    """
    per_prompt = [r for r in rounds_emitted if len(r)]
    rounds = sum(len(r) for r in per_prompt)
    if rounds == 0:
        return math.nan, (math.nan, math.nan)
    tau = sum(sum(r) for r in per_prompt) / rounds
    if len(per_prompt) >= 8:
        num, den = [sum(r) for r in per_prompt], [len(r) for r in per_prompt]
    else:
        num = [x for r in per_prompt for x in r]
        den = [1] * len(num)
    if len(num) < 2:
        return tau, (math.nan, math.nan)
    f64 = torch.float64
    _, ci = ratio_ci(
        torch.tensor(num, dtype=f64), torch.tensor(den, dtype=f64), n_boot=2000, seed=seed
    )
    return tau, ci


def speedup_and_ci(
    spec_tokens: Sequence[float],
    spec_seconds: Sequence[float],
    ar_tokens: Sequence[float],
    ar_seconds: Sequence[float],
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """Speculative over autoregressive tokens/s, `(sum spec_tokens / sum spec_seconds) /
    (sum ar_tokens / sum ar_seconds)`, with a percentile bootstrap CI over prompts.

    Why: the two decodes of a prompt are timed alternately, so a prompt is the unit that
    carries both its text's tau and the machine's drift at that moment; resampling prompts
    (the same draw for all four sums) shows how much a speedup measured on a few prompts
    would move on others, which one ratio hides."""
    cols = torch.tensor(
        [spec_tokens, spec_seconds, ar_tokens, ar_seconds], dtype=torch.float64
    ).T  # [prompts, 4]
    if cols.shape[0] == 0 or float(cols[:, 1].sum()) <= 0 or float(cols[:, 3].sum()) <= 0:
        raise ValueError("speedup needs at least one prompt with timed decodes")

    def ratio(sums: torch.Tensor) -> torch.Tensor:
        return (sums[..., 0] / sums[..., 1]) / (sums[..., 2] / sums[..., 3])

    point = float(ratio(cols.sum(0)))
    if cols.shape[0] < 2:
        return point, (math.nan, math.nan)
    return point, percentile_interval(ratio(resampled_sums(cols, n_boot, seed)))


@dataclass
class Progress:
    """What `decode` reports after each prompt (to a tqdm bar and/or a callback)."""

    done: int
    total: int
    tokens_per_s: float
    tau: float
    ar_tokens_per_s: float | None
