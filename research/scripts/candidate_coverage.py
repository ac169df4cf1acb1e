"""How often a DFlash2 drafter's candidate selector *can* propose the rollout's token.

At T > 0 the selector's q lives on the top-`selector_top_k` tokens of the unary logits
only, so a label outside them has q = 0 and is always rejected. This prints the share of
the labels (every slot of every round start, teacher-forced) inside that top-k:

    python research/scripts/candidate_coverage.py --target tiny DRAFTER_DIR ROLLOUTS_DIR
"""

from __future__ import annotations

import argparse

import torch

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.serialization.checkpoint import load_drafter, read_config
from blockdraft.targets.registry import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="a DFlash2 checkpoint directory")
    ap.add_argument("rollouts", help="a rollout directory")
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--limit", type=int, default=32, help="rollouts read (default 32)")
    args = ap.parse_args()
    layers = read_config(args.drafter)["blockdraft"]["drafter_config"]["target_layer_ids"]
    target = load_target(args.target, layer_ids=list(layers))
    drafter = load_drafter(args.drafter, target).eval()
    k = drafter.config.num_proposals
    inside = total = 0
    with torch.no_grad():
        for r in list(RolloutSet.open(args.rollouts))[: args.limit]:
            seq = torch.cat([r.prompt_ids, r.response_ids]).long()[None]
            start = r.prompt_ids.numel() - 1
            anchors = torch.arange(start, seq.shape[1] - 1)[None]
            hidden = drafter.forward_blocks(target.forward(seq).features, seq, anchors)[0]
            candidates = drafter.candidates(hidden)  # [A, K, top_k] draft columns
            idx = anchors[0][:, None] + torch.arange(1, k + 1)
            valid = idx < seq.shape[1]
            labels = seq[0][idx.clamp_max(seq.shape[1] - 1)]
            ids = drafter.draft_ids
            if ids is not None:
                candidates = ids[candidates]
            hit = (candidates == labels[..., None]).any(-1)
            inside += int(hit[valid].sum())
            total += int(valid.sum())
    top = drafter.config.selector_top_k
    print(f"labels inside the unary top-{top}: {inside / total:.3f} of {total} slots")


if __name__ == "__main__":
    main()
