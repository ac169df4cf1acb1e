"""Where a drafter wins and loses against the baseline (prompt lookup), round start by round start.

A suite's MAL says *whether* a drafter beats prompt lookup; this says *where*: every round
start is grouped by how many tokens the baseline gets accepted there (none, 1-3, 4 to K-1,
all K), with each drafter's mean accepted length per group (over round starts, not
weighted by decoding's visits as MAL is), and the exact MAL of the per-round oracle taking
the longer of the two prefixes: what a fallback such as `hybrid:` could reach at best.
"""

from __future__ import annotations

from typing import Any

import torch

from blockdraft.evaluation.offline import offline_stats

Tensor = torch.Tensor


def accepted_lengths(acc: Tensor) -> Tensor:
    """Expected accepted prefix `[L-1]` at each round start of one rollout's acceptance
    tensor `[L-1, K]` (slot k is accepted with probability `acc[:, k]` once slots < k are:
    `sum_k prod_{j<=k} acc[:, j]`; at T = 0 the count of leading accepted slots). Near the
    end only the proposals that exist count (start i has `L-1-i` tokens left), as in the
    evaluator, whatever the tensor holds past them."""
    rows, k = acc.shape
    left = torch.arange(rows, 0, -1).view(-1, 1)  # tokens after round start i
    exists = torch.arange(1, k + 1).view(1, -1) <= left
    return torch.cumprod(torch.where(exists, acc.double(), 0.0), dim=-1).sum(-1)


def group_index(lengths: Tensor, k: int) -> Tensor:
    """0: nothing accepted, 1: 1-3, 2: 4 to K-1, 3: all K (`group_labels`)."""
    g = torch.zeros(lengths.shape, dtype=torch.long)
    g[lengths >= 0.5] = 1
    g[lengths >= 3.5] = 2
    g[lengths >= k - 0.5] = 3
    return g


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}-{hi}" if lo < hi else ""


def group_labels(k: int) -> list[str]:
    """Labels of `group_index`'s groups for K proposals ("" for a group that cannot occur)."""
    return ["0", _span(1, min(3, k - 1)), _span(4, k - 1), f"{k}"]


def per_round_oracle(base: list[Tensor], other: list[Tensor]) -> list[Tensor]:
    """Acceptance tensors of the oracle that proposes, at each round start, whichever of
    the two accepts more there (its rows, so its MAL is exact under the evaluator)."""
    out = []
    for a, b in zip(base, other, strict=True):
        take = accepted_lengths(b) > accepted_lengths(a)
        out.append(torch.where(take[:, None], b, a))
    return out


def lookup_split(scored: list[list[Tensor]], names: list[str]) -> dict[str, Any]:
    """The split of one benchmark (module doc): `scored[0]` is the baseline's acceptance
    tensors, the others the drafters', all on the same rollouts. JSON-ready."""
    k = int(scored[0][0].shape[-1])
    lengths = [torch.cat([accepted_lengths(a) for a in acc]) for acc in scored]
    groups = group_index(lengths[0], k)
    rows = []
    for g, label in enumerate(group_labels(k)):
        sel = groups == g
        if not bool(sel.any()):
            continue
        rows.append(
            {
                "baseline_accepts": label,
                "share": float(sel.double().mean()),
                "mean_accepted": {
                    n: float(x[sel].mean()) for n, x in zip(names, lengths, strict=True)
                },
            }
        )
    return {
        "round_starts": int(groups.numel()),
        "groups": rows,
        "oracle_mal": {
            n: offline_stats(per_round_oracle(scored[0], acc)).mal
            for n, acc in zip(names[1:], scored[1:], strict=True)
        },
    }
