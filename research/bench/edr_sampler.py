"""EDR round-start samplers: step time and gradient variance, side by side in one run.

Why: when a rollout has more round starts than `objective.max_anchors`, the EDR step
drafts only a sample of them with gradient and weights them by 1 / inclusion probability
(training/steps/rounds.py). All samplers give unbiased gradients; they differ in cost and
variance:

- `uniform` draws the rows first and scores only the others without gradient (each
  round start drafted once);
- `occupancy` scores every round start first, then draws rows proportionally to their
  round-start occupancy and drafts them again with gradient;
- `gradient` (the default) does the same as `occupancy` but draws proportionally to an
  estimate of each row's gradient norm (`gradient_sizes`).

What a user pays for is the noise left after a fixed amount of compute, so the bench
prints, for each sampler, the step time relative to the exact step that drafts every
round start with gradient, the relative gradient variance `E||g - g_full||^2 /
||g_full||^2` over `--draws` sampling seeds, and their product (variance x time: lower is
better; equal products mean equal noise per second of training).

It runs on a trained drafter and real rollouts, because occupancies of a random drafter
say nothing about the ones training sees; by default the demo's (`make demo`):

    python research/bench/edr_sampler.py [--demo blockdraft-demo] [--drafter DIR] [--rollouts DIR]
        [--max-anchors 32] [--batch 4] [--draws 100] [--rounds 5] [--mode auto]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.objectives.registry import make_objective
from blockdraft.serialization.checkpoint import load_drafter
from blockdraft.targets.registry import load_target
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import OnlineTargetFeatures
from blockdraft.training.steps import StepInputs
from blockdraft.training.steps.rounds import rounds_step

SAMPLERS = ("uniform", "occupancy", "gradient")


class _Settings:  # the rollouts' sampling settings (filled from the manifest)
    temperature, top_p, top_k, greedy = 1.0, 1.0, 0, True


def _step(fwd, drafter, target, objective, batch, mode: str, seed: int) -> torch.Tensor:
    """One EDR micro-step + backward; the flattened gradient."""
    drafter.zero_grad(set_to_none=True)
    inputs = StepInputs(
        fwd, drafter, OnlineTargetFeatures(target), objective, _Settings, seed=seed, mode=mode,
        stop_token_ids=target.stop_token_ids,
    )  # fmt: skip
    out = rounds_step(inputs, batch, 0, False)
    out.numerator.backward()
    return torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])


def common_arguments(ap: argparse.ArgumentParser) -> None:
    """Drafter, rollouts and batch options shared with research/bench/edr_sampler_sizes.py."""
    ap.add_argument("--demo", default="blockdraft-demo", help="a `blockdraft demo` output dir")
    ap.add_argument("--drafter", help="drafter dir (default: DEMO/runs/dpace/final)")
    ap.add_argument("--rollouts", help="rollout set (default: DEMO/rollouts/train/set)")
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--max-anchors", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="rollouts per micro-batch")
    ap.add_argument("--mode", default="auto", choices=["auto", "greedy", "sampling"])
    ap.add_argument("--threads", type=int, default=1)


def load_inputs(args: argparse.Namespace):
    """`(target, drafter, DraftForward, batch, mode, drafter_dir)` from the options; the
    rollouts' sampling settings go into `_Settings`."""
    torch.set_num_threads(args.threads)
    demo = Path(args.demo)
    drafter_dir = Path(args.drafter or demo / "runs" / "dpace" / "final")
    rollout_dir = Path(args.rollouts or demo / "rollouts" / "train" / "set")
    for what, path in (("drafter", drafter_dir), ("rollouts", rollout_dir)):
        if not path.exists():
            raise SystemExit(f"{what}: {path} does not exist (run `make demo` or pass --{what})")
    target = load_target(args.target)
    drafter = load_drafter(drafter_dir, target, adopt_layer_ids=True)
    drafter.train()
    rollouts = RolloutSet.open(rollout_dir)
    sampling = rollouts.manifest.get("settings", {})
    _Settings.temperature = float(sampling.get("temperature", 0.0)) or 1.0
    _Settings.top_p = float(sampling.get("top_p", 1.0))
    _Settings.top_k = int(sampling.get("top_k", 0) or 0)
    _Settings.greedy = float(sampling.get("temperature", 0.0)) == 0.0
    mode = args.mode if args.mode != "auto" else ("greedy" if _Settings.greedy else "sampling")
    rows = [rollouts[i] for i in range(args.batch)]
    batch = collate(rows, list(range(len(rows))), 0, 4096)
    return target, drafter, DraftForward(drafter), batch, mode, drafter_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap)
    ap.add_argument("--draws", type=int, default=100, help="sampling seeds per sampler")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    args = ap.parse_args()
    target, drafter, fwd, batch, mode, drafter_dir = load_inputs(args)
    lengths = [int(n) for n in batch.response_lens]

    full = make_objective("edr", mode=mode, max_anchors=1 << 30)
    g_full = _step(fwd, drafter, target, full, batch, mode, 0).double()
    samplers = list(SAMPLERS)
    objectives = {
        s: make_objective("edr", mode=mode, max_anchors=args.max_anchors, anchor_sampler=s)
        for s in samplers
    }
    variance = {}
    for s, obj in objectives.items():
        err = [
            float(
                ((_step(fwd, drafter, target, obj, batch, mode, seed).double() - g_full) ** 2).sum()
            )
            for seed in range(args.draws)
        ]
        variance[s] = statistics.fmean(err) / float((g_full**2).sum())

    names = ["all", *samplers]
    objectives["all"] = full
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds + 1):  # round 0 warms up
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            _step(fwd, drafter, target, objectives[n], batch, mode, 1000 + r)
            if r:
                times[n].append(time.perf_counter() - t0)
    t_all = statistics.median(times["all"])

    print(
        f"EDR samplers ({mode} mode, {len(lengths)} rollouts of {lengths} response tokens, "
        f"max_anchors {args.max_anchors}, drafter {drafter_dir}, {args.draws} draws):"
    )
    print(f"  {'sampler':10s} {'time vs all':>12s} {'rel. variance':>14s} {'var x time':>11s}")
    noise = {}
    for s in samplers:
        t = statistics.median(times[s]) / t_all
        noise[s] = variance[s] * t
        print(f"  {s:10s} {t:11.3f}x {variance[s]:14.4f} {noise[s]:11.4f}")
    for s in samplers:
        if s != "occupancy":
            print(
                f"  noise per unit of compute, {s} / occupancy: "
                f"{noise[s] / noise['occupancy']:.3f} (< 1: {s} better)"
            )


if __name__ == "__main__":
    main()
