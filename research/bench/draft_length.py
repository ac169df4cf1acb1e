"""Fewer draft tokens per round: exact offline MAL against this machine's round cost (T = 0).

    python research/bench/draft_length.py --drafter blockdraft-demo/runs/dpace/final \
        --rollouts blockdraft-demo/rollouts/eval/set

Speculative decoding's speedup is MAL / round cost in AR steps, and a round verifying
fewer tokens costs less. Two ways to propose fewer, both exact offline because the cut
depends only on the round's context (a shorter proposal: the slots past it get
acceptance 0): a fixed K (engines' `num_speculative_tokens`), and a per-round cut at the
first slot whose max probability is below a threshold (at least one slot). For each, the
exact MAL on greedy rollouts, the mean proposals per round and the mean round cost, both
weighted by each round start's occupancy, with the cost measured here in one run: the
target's lean forward at 1..K+1 tokens and the drafter's lean round + head, interleaved,
medians, in AR steps (the 1-token forward). The speedup column is that cost model's; the
loop's own overheads (bench/decode.py) put it lower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.decoding.cpu.lean_drafter import LeanDrafter
from blockdraft.decoding.proposers import GreedyDraftHead
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollout_set
from blockdraft.objectives.edr.recursion import pad_rollouts, state_occupancy
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.targets.registry import load_target


def slot_confidences(drafter, target, rollouts) -> list[torch.Tensor]:
    """Per rollout the drafter's max probability per slot `[L-1, K]` at every round start
    (softmax at T = 1, as `hybrid:` reads confidence); acceptances come from the
    evaluator itself (`score_rollout_set`)."""
    out = []
    k = int(drafter.config.block_size) - 1
    slots = torch.arange(1, k + 1)
    for r in rollouts:
        prompt = torch.as_tensor(r.prompt_ids).long().reshape(-1)
        response = torch.as_tensor(r.response_ids).long().reshape(-1)
        if response.numel() < 2:  # no drafting round: the evaluator's [0, K] too
            out.append(torch.zeros(0, k))
            continue
        seq = torch.cat([prompt, response])
        features = target.forward(seq[None], logits_to_keep=1).features
        anchors = round_start_anchors(prompt.numel(), response.numel())
        hidden = drafter.forward_blocks(features, seq[None], anchors[None])[0]
        idx = (anchors[:, None] + slots[None]).clamp_max(seq.numel() - 1)
        logits = drafter.compute_logits(hidden, seq[idx - 1]).float()
        out.append(torch.softmax(logits, -1).amax(-1)[: response.numel() - 1])
    return out


def round_costs(drafter, target, k: int, reps: int) -> tuple[list[float], float]:
    """(target forward at 1..k+1 tokens, drafter lean round + head), in AR steps."""
    lean, head, run = LeanDrafter.of(drafter), GreedyDraftHead.of(drafter), TargetRunner(target)
    if lean is None:
        raise SystemExit("no lean round for this drafter (LeanDrafter.supports)")
    g = torch.Generator().manual_seed(0)
    a = 60
    prompt = torch.randint(3, target.vocab_size, (1, a + k + 1), generator=g)
    pre = run.step(prompt[:, :a], features=True)
    cache, state = pre.cache, lean.new_state()
    lean.extend_context(state, pre.features[:, : a - 3], 0)
    lean.draft_hidden(state, 5, a - 3)

    def forward(n: int) -> None:
        run.step(prompt[:, a : a + n], cache, keep=n, features=n > 1, argmax=True).argmax()
        run.crop(cache, a)

    def draft() -> None:
        lean.extend_context(state, pre.features[:, a - 3 : a], a - 3)
        head.pick(lean.draft_hidden(state, 5, a))
        state.crop(a - 3)

    jobs = {n: (lambda n=n: forward(n)) for n in range(1, k + 2)}
    jobs["draft"] = draft
    times: dict = {name: [] for name in jobs}
    for _ in range(reps):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    return [med[n] / med[1] for n in range(1, k + 2)], med["draft"] / med[1]


def policy_row(accs, confs, lengths_of, verify: list[float], draft: float) -> tuple:
    """(MAL, mean proposals per round, mean round cost, MAL / cost) of one cut policy."""
    cut, counts = [], []
    for a, c in zip(accs, confs, strict=True):
        n = lengths_of(c)
        cut.append(a * (torch.arange(a.shape[1])[None] < n[:, None]))
        counts.append(n)
    mal = offline_stats(cut).mal
    padded, lengths = pad_rollouts(cut)
    occupancy = state_occupancy(padded, lengths)[..., 0]  # [R, M]: P(round starts at n)
    n = torch.zeros_like(occupancy)
    for i, c in enumerate(counts):
        n[i, : c.numel()] = c.double()
    cost_of = torch.tensor(verify, dtype=torch.float64)[n.long()] + draft  # n proposals: n+1 rows
    rounds = occupancy.sum()
    mean_n = float((occupancy * n).sum() / rounds)
    cost = float((occupancy * cost_of).sum() / rounds)
    return mal, mean_n, cost, mal / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--rollouts", required=True, help="a greedy rollout set (T = 0)")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--reps", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(args.target)
    drafter, _ = load_drafter_spec(DrafterSpec.parse(args.drafter), target)
    rollouts = RolloutSet.open(args.rollouts)
    if not rollouts.settings.greedy:
        raise SystemExit(f"{args.rollouts}: sampled rollouts; this bench scores T = 0 only")
    accs = [a.double() for a in score_rollout_set(drafter.eval(), target, rollouts)]
    with torch.inference_mode():
        confs = slot_confidences(drafter, target, rollouts)
        verify, draft = round_costs(drafter, target, accs[0].shape[1], args.reps)
    k = accs[0].shape[1]
    print(f"{len(accs)} rollouts; drafter round + head {draft:.2f} AR steps; target forward "
          + ", ".join(f"{n + 1} tok {c:.2f}" for n, c in enumerate(verify)))  # fmt: skip
    print(f"{'policy':<18} {'MAL':>6} {'proposals':>9} {'cost':>6} {'MAL/cost':>9}")
    for n in range(1, k + 1):
        row = policy_row(accs, confs, lambda c, n=n: torch.full((c.shape[0],), n), verify, draft)
        print(f"K = {n:<14} {row[0]:6.3f} {row[1]:9.2f} {row[2]:6.2f} {row[3]:9.3f}")
    for thr in args.thresholds:

        def first_low(c: torch.Tensor, thr: float = thr) -> torch.Tensor:
            low = c < thr
            at = torch.where(low.any(-1), low.float().argmax(-1), c.shape[1])
            return at.clamp_min(1)

        row = policy_row(accs, confs, first_low, verify, draft)
        print(f"cut at conf < {thr:<4} {row[0]:6.3f} {row[1]:9.2f} {row[2]:6.2f} {row[3]:9.3f}")


if __name__ == "__main__":
    main()
