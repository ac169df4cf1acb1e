"""How much a reduced draft vocabulary caps MAL on held-out rollouts.

For each rollout set: the share of response tokens outside the draft vocabulary, and the
exact MAL of a drafter that is always right inside the vocabulary and never outside it
(acceptance 1 for an in-vocabulary token, 0 otherwise, scored by the offline evaluator):
what no training recipe can beat at this vocabulary. The vocabulary is the `size` most
frequent tokens of the training rollouts, stop tokens always in (what `train` builds), or
the one a checkpoint carries.

    python research/scripts/vocab_ceiling.py --target smollm2-135m --train ROLLOUTS \
        --size 8192 --size 16384 --size 49152 --block 8 HELDOUT_ROLLOUTS...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.drafters.draft_vocab import draft_ids_from_d2t, most_frequent_tokens
from blockdraft.evaluation.offline import offline_stats
from blockdraft.targets.registry import load_target


def perfect_in_vocab(response: torch.Tensor, in_vocab: torch.Tensor, k: int) -> torch.Tensor:
    """Acceptance `[L-1, K]` of the in-vocabulary oracle: proposal h of the round starting
    at n (token x_{n+h}) is accepted iff that token is in the vocabulary."""
    ok = in_vocab[response.long()].double()
    rows = response.numel() - 1
    acc = torch.zeros(rows, k, dtype=torch.float64)
    for h in range(1, k + 1):
        acc[: max(rows - h + 1, 0), h - 1] = ok[h:]
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--train", help="training rollouts the vocabulary is counted on")
    p.add_argument("--checkpoint", help="or: a checkpoint's model.safetensors carrying d2t")
    p.add_argument("--size", type=int, action="append", default=[])
    p.add_argument("--block", type=int, default=8, help="block size (K + 1)")
    p.add_argument("heldout", nargs="+", help="held-out rollout sets (e.g. a suite's)")
    args = p.parse_args()
    target = load_target(args.target)
    vocabs: dict[str, torch.Tensor] = {}
    if args.checkpoint:
        vocabs["checkpoint"] = draft_ids_from_d2t(load_file(args.checkpoint)["d2t"])
    if args.train:
        seqs = [
            torch.cat([r.prompt_ids, r.response_ids])
            for r in RolloutSet.open(Path(args.train), allow_incomplete=True)
        ]
        for size in args.size:
            vocabs[str(size)] = most_frequent_tokens(
                seqs, size, target.vocab_size, always_include=target.stop_token_ids
            )
    k = args.block - 1
    print("| held-out set | vocabulary | tokens outside | in-vocab oracle MAL |")
    print("|---|---|---|---|")
    for directory in args.heldout:
        rollouts = list(RolloutSet.open(Path(directory)))
        for name, ids in vocabs.items():
            mask = torch.zeros(target.vocab_size, dtype=torch.bool)
            mask[ids] = True
            tokens = torch.cat([r.response_ids.long() for r in rollouts])
            outside = 1.0 - float(mask[tokens].double().mean())
            stats = offline_stats([perfect_in_vocab(r.response_ids, mask, k) for r in rollouts])
            print(f"| {Path(directory).name} | {name} | {outside:.2%} | {stats.mal:.3f} |")


if __name__ == "__main__":
    main()
