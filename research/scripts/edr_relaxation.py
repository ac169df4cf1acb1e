#!/usr/bin/env python
"""Greedy EDR's relaxed objective next to the true one, checkpoint by checkpoint.

Why (issue #31): greedy EDR trains `A = softmax(z / beta)(x)` (beta = 1: `A = q(x)`),
while greedy decoding accepts `1[argmax q = x]`. This script scores every checkpoint of
one or more fine-tuning runs on a greedy rollout set and prints, per checkpoint, the
true expected rounds per emitted token (= 1 / MAL, what decoding pays) and the relaxed
one at each beta, so one can see whether the relaxed objective improves while the true
one gets worse; plus the true acceptance per slot (AR_k over all round starts).

    python research/scripts/edr_relaxation.py --target tiny --rollouts DIR [--limit 64] \
        --betas 1,0.25 [--steps 0,16,32,48] RUN_DIR... [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.evaluation.scoring import FeatureMemo
from blockdraft.objectives.edr import expected_rounds
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.targets.registry import load_target


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the run's start (`drafter.init_from` in run.yaml, step 0), every
    `checkpoints/step-N` and `final`."""
    out = []
    spec = (run / "run.yaml").read_text() if (run / "run.yaml").exists() else ""
    m = re.search(r"init_from:\s*(\S+)", spec)
    if m and m.group(1) not in ("null", "None"):
        out.append((0, Path(m.group(1))))
    steps = [(int(d.name.split("-")[1]), d) for d in (run / "checkpoints").glob("step-*")]
    out.extend(sorted(steps))
    if (run / "final").is_dir():
        step = max([s for s, _ in out] + [0]) + 1  # after the last checkpoint
        meta = run / "final" / "trainer_state.json"
        if meta.exists():
            step = int(json.loads(meta.read_text()).get("step", step))
        if not steps or max(steps)[0] != step:  # else final/ = the last step checkpoint
            out.append((step, run / "final"))
    return out


@torch.no_grad()
def score(drafter, target, rollouts, memo, betas):
    """Per rollout: log q_beta(x) `[len(betas), L-1, K]` and the hard acceptance."""
    k = int(drafter.config.num_proposals)
    slots = torch.arange(1, k + 1)
    logq, hard = [], []
    for r in rollouts:
        prompt, resp = r.prompt_ids.long().reshape(-1), r.response_ids.long().reshape(-1)
        P, L = prompt.numel(), resp.numel()
        if L < 2:
            continue
        seq = torch.cat([prompt, resp])
        feats = memo.features(target, seq)
        anchors = round_start_anchors(P, L)
        hidden = drafter.forward_blocks(feats, seq.unsqueeze(0), anchors.unsqueeze(0))[0]
        idx = anchors[:, None] + slots[None, :]
        valid = idx < seq.numel()
        labels = seq[idx.clamp_max(seq.numel() - 1)]
        prev = seq[(idx - 1).clamp_max(seq.numel() - 1)]
        z = drafter.compute_logits(hidden, prev).double()
        hard.append(torch.where(valid, (z.argmax(-1) == labels).double(), 0.0))
        per_beta = []
        for b in betas:
            lq = torch.log_softmax(z / b, -1).gather(-1, labels[..., None])[..., 0]
            per_beta.append(torch.where(valid, lq, -torch.inf))
        logq.append(torch.stack(per_beta))
    return logq, hard


def rounds_per_token(accs: list[torch.Tensor]) -> float:
    tokens = sum(a.shape[0] for a in accs)
    return float(sum(float(expected_rounds(a.float())) for a in accs)) / tokens


def slot_acceptance(hard: list[torch.Tensor]) -> list[float]:
    """Mean true acceptance of slot h over all round starts where it exists."""
    k = hard[0].shape[1]
    out = []
    for h in range(k):
        vals = torch.cat([a[: max(a.shape[0] - h, 0), h] for a in hard])
        out.append(float(vals.mean()) if vals.numel() else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--rollouts", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--betas", default="1,0.25")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--steps", default=None, help="only these steps, e.g. 0,16,32,48")
    args = ap.parse_args()
    betas = [float(b) for b in args.betas.split(",")]
    target = load_target(args.target)
    rs = RolloutSet.open(args.rollouts)
    if float(rs.manifest["settings"]["temperature"]) != 0:
        raise SystemExit(f"error: {args.rollouts}: not greedy rollouts (temperature != 0)")
    rollouts = list(rs.subset(range(min(args.limit, len(rs)))))
    memo = FeatureMemo()
    rows = []
    head = " | ".join(f"J_soft(beta={b})" for b in betas)
    print(f"| run | step | J_true (1/MAL) | {head} | true acceptance per slot |")
    print("|---|---|---|" + "---|" * len(betas) + "---|")
    for run in args.runs:
        wanted = None if args.steps is None else {int(x) for x in args.steps.split(",")}
        for step, ckpt in checkpoints(run):
            if wanted is not None and step not in wanted:
                continue
            drafter, _ = load_drafter_spec(DrafterSpec(path=str(ckpt)), target)
            logq, hard = score(drafter, target, rollouts, memo, betas)
            soft = [rounds_per_token([lq[i].exp() for lq in logq]) for i in range(len(betas))]
            row = {
                "run": str(run),
                "step": step,
                "true": rounds_per_token(hard),
                "soft": dict(zip(map(str, betas), soft, strict=True)),
                "slot_acceptance": slot_acceptance(hard),
            }
            rows.append(row)
            cells = " | ".join(f"{v:.4f}" for v in soft)
            slots = " ".join(f"{a:.3f}" for a in row["slot_acceptance"])
            print(f"| {run.name} | {step} | {row['true']:.4f} | {cells} | {slots} |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
