"""What a drafter would give if each round proposed only its confident prefix, at T = 0.

Why: on a CPU the target's verify forward grows with the tokens it checks, and a DFlash
drafter always proposes all K, where prompt lookup proposes nothing when it has no match.
This scores a drafter on greedy rollouts as the evaluator does (the same block forward,
greedy acceptance), cuts each round's block before the first slot whose confidence (the
softmax maximum over the drafter's own vocabulary) is below a threshold, and prints per
threshold the MAL (exact, `offline_stats` on the trimmed acceptances), the tokens proposed
a round and the tokens each verified token yields. It does not serve anything: it says
whether trimming is worth building into an engine.

    python research/scripts/confidence_trim.py RUN [--rollouts SET ...] [--thresholds ...]
"""

from __future__ import annotations

import argparse

import torch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.decoding.proposers import proposals_per_round
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import _target_features, acceptance_tensor
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.targets.registry import load_target
from blockdraft.threads import configure_cpu
from blockdraft.user_cache import cache_root


@torch.no_grad()
def scored(drafter, target, prompt_ids, response_ids):
    """`[L-1, K]` greedy acceptance (the evaluator's own) and slot confidence at every
    round start (the same block forward, its softmax maximum)."""
    acc = acceptance_tensor(drafter, target, prompt_ids, response_ids, None, 0.0)
    k = proposals_per_round(drafter)
    prompt_ids, response_ids = prompt_ids.long().reshape(-1), response_ids.long().reshape(-1)
    seq = torch.cat([prompt_ids, response_ids])
    anchors = round_start_anchors(prompt_ids.numel(), response_ids.numel())
    idx = anchors[:, None] + torch.arange(1, k + 1)[None, :]
    prev = seq[(idx - 1).clamp_max(seq.numel() - 1)]
    features = _target_features(target, seq)
    hidden = drafter.forward_blocks(features, seq.unsqueeze(0), anchors.unsqueeze(0))[0]
    logits = drafter.compute_draft_logits(hidden, prev).float()
    return acc, torch.softmax(logits, -1).amax(-1)


def walk(acc: torch.Tensor, kept: torch.Tensor) -> tuple[int, int]:
    """(rounds, tokens proposed) of greedy decoding along one rollout."""
    rounds = proposed = pos = 0
    while pos < acc.shape[0]:
        a = int(acc[pos].cumprod(0).sum())
        rounds, proposed, pos = rounds + 1, proposed + int(kept[pos].sum()), pos + a + 1
    return rounds, proposed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--rollouts", action="append", help="greedy rollout sets (default: the suite)")
    p.add_argument("--thresholds", default="0,0.02,0.05,0.1,0.2,0.3,0.5")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    configure_cpu(args.threads, "cpu")
    target = load_target(args.target, progress=False)
    drafter, _ = load_drafter_spec(DrafterSpec(path=args.drafter), target)
    suite = cache_root() / "smollm2-recipe" / "suite-rollouts"
    sets = args.rollouts or [
        str(next(suite.glob(b + "-*"))) for b in ("gsm8k", "humaneval", "mt-bench")
    ]
    per_set = []
    for d in sets:
        rs = RolloutSet.open(d)
        if not rs.settings.greedy:
            raise SystemExit(f"confidence_trim.py: {d}: greedy rollouts only")
        per_set.append([scored(drafter, target, r.prompt_ids, r.response_ids) for r in rs])
    thresholds = [float(t) for t in args.thresholds.split(",")]
    print(f"{args.drafter}: {', '.join(d.rstrip('/').split('/')[-1] for d in sets)}")
    print("| min confidence | MAL (sets' mean) | vs untrimmed | proposed a round | "
          "tokens per verified token |\n|---|---|---|---|---|")  # fmt: skip
    base = None
    for c in thresholds:
        mals, proposed, rounds, made, verified = [], 0, 0, 0, 0
        for rows in per_set:
            trimmed = []
            for acc, conf in rows:
                kept = (conf >= c).float().cumprod(-1)
                trimmed.append(acc * kept)
                n_rounds, n_proposed = walk(acc * kept, kept)
                rounds, proposed = rounds + n_rounds, proposed + n_proposed
                made, verified = made + acc.shape[0], verified + n_rounds + n_proposed
            mals.append(offline_stats(trimmed).mal)
        mal = sum(mals) / len(mals)
        base = base or mal
        print(f"| {c:g} | {mal:.3f} | {100 * (mal / base - 1):+.1f}% | "
              f"{proposed / rounds:.2f} | {made / verified:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
