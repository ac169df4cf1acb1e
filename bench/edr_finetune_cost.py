"""The fine-tune epoch's cost: one EDR / E2E / D-PACE training step on the same batch of
real rollouts, side by side in one run (issue #31's goal: a fine-tune <= 1.3x a D-PACE
epoch of the same size).

Same rollouts and steps per epoch on every row, so the step ratio is the epoch ratio.
Rows: D-PACE at the demo's 64 anchors per sequence (the control; `--anchors 32` for a run
that trains at 32, as configs/gemma-3-270m.yaml), D-PACE at every round start (the same
blocks EDR trains), E2E at the control's anchors, and EDR (in the rollouts' mode, as
training reads it: greedy at beta 0.5, or sampling) on every round start and with
`max_anchors` 16 / 32 / 64 (the `gradient` PPS sampler, whose exact gradient needs a
no-grad scoring pass over every round start; the demo's fine-tune is the greedy 32 row),
and 32 / 64 drawn uniformly (only the rows not drawn are scored); `--score-chunks 16 128`
adds EDR @16 with its scoring pass split into passes of that many round starts per
rollout (the sampling-mode default, `rounds.default_score_chunk`, is one pass here).
`--amp bf16` runs every row's forward under CPU bf16 autocast, as `amp: bf16` trains (the
rows' ratio then says what the fine-tune costs on a CPU with bf16 matrix units);
`--features` reads cached target features for every row (rollouts that store their whole
sampling distributions need no target at all then). `--tensor-sums` adds EDR @16 with
the scoring pass's whole-vocabulary sums as tensor ops (the GPU path) instead of the
compiled CPU loop, to the same rounds. One thread by default and glibc keeping freed
memory, as `blockdraft train` runs on a CPU. Each round times
every row once in rotating order, on the same micro-batch; the factor is the median over
rounds of time(row) / time(the control), printed with the range of the rounds' factors.
`--also-rollouts DIR` adds E2E and EDR @16 on a second set at the same settings to the
same rounds (e.g. the same tokens with and without stored distributions: side by side).

`--phases` then profiles the control, E2E and EDR @16 for 3 steps each (torch profiler,
a `record_function` label around each phase: target forward, drafter forward, the target's
distributions, the overlap, EDR's scoring pass and its parts, backward) and prints each
phase in ms per step.

    python bench/edr_finetune_cost.py --drafter RUN/final --rollouts DIR [--rounds 9] [--threads 1]
        [--phases] [--score-chunks 16 32] [--amp bf16] [--features DIR] [--tensor-sums]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import blockdraft.objectives.edr as edr_package
import blockdraft.objectives.edr.acceptance as edr_acceptance
import blockdraft.training.steps.block as block
import blockdraft.training.steps.proposal_scores as proposal_scores
import blockdraft.training.steps.rounds as rounds
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.heap import retain_freed_memory
from blockdraft.objectives.registry import make_objective
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.targets.registry import load_target
from blockdraft.threads import flush_denormals
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import CachedFeatures, OnlineTargetFeatures
from blockdraft.training.steps import StepInputs
from blockdraft.training.steps.block import block_step
from blockdraft.training.steps.rounds import rounds_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--rollouts", required=True)
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--anchors", type=int, default=64, help="the control's anchors per sequence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phases", action="store_true", help="also profile the phases of 3 rows")
    ap.add_argument(
        "--score-chunks", type=int, nargs="*", default=[],
        help="also EDR @16 with the scoring pass in passes of these many round starts",
    )  # fmt: skip
    ap.add_argument(
        "--features",
        default=None,
        help="a `blockdraft features` directory of --rollouts: every row reads the cached "
        "target features instead of running the target (as a run with data.features trains)",
    )
    ap.add_argument(
        "--also-rollouts",
        default=None,
        help="a second rollout set at the same settings (e.g. the same tokens written with "
        "--store-topk 0): E2E and EDR @16 on it too, timed in the same rounds (online target)",
    )
    ap.add_argument(
        "--tensor-sums",
        action="store_true",
        help="also EDR @16 with its scoring pass's vocabulary sums as tensor ops (what a GPU "
        "runs) instead of the compiled CPU loop (`edr/vocab_sums.py`), in the same rounds",
    )
    ap.add_argument(
        "--amp", choices=["fp32", "bf16"], default="fp32",
        help="bf16: forward under CPU bf16 autocast, as `amp: bf16` trains",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flush_denormals()
    retain_freed_memory()  # as `blockdraft train` does on a CPU (heap.py)
    target = load_target(args.target)
    drafter, _ = load_drafter_spec(DrafterSpec.parse(args.drafter), target)
    drafter.train()
    for p in drafter.parameters():
        p.requires_grad_(True)
    if args.also_rollouts and args.features:
        raise SystemExit("--also-rollouts times its rows with the online target: drop --features")
    rs = RolloutSet.open(args.rollouts)
    settings = SamplingSettings.from_dict(rs.manifest["settings"])
    mode = "greedy" if settings.greedy else "sampling"  # as training reads it
    rollouts = list(rs.subset(range(args.batch)))
    pad = getattr(target.tokenizer, "pad_token_id", None)
    max_len = 4096
    batch = collate(rollouts, list(range(len(rollouts))), int(pad or 0), max_len)
    other = None
    if args.also_rollouts:
        also = RolloutSet.open(args.also_rollouts)
        if SamplingSettings.from_dict(also.manifest["settings"]) != settings:
            raise SystemExit(f"{args.also_rollouts}: other sampling settings than {args.rollouts}")
        picked = list(also.subset(range(args.batch)))
        other = collate(picked, list(range(len(picked))), int(pad or 0), max_len)
    fwd, feats = DraftForward(drafter), OnlineTargetFeatures(target)
    if args.features:
        feats = CachedFeatures.open(
            args.features, target=target, rollout_dir=args.rollouts, rollouts=rollouts,
            max_seq_len=max_len,
        )  # fmt: skip
    rows_per = int(batch.response_lens.max()) - 1

    def block(name: str, anchors: int, on=batch, **params):
        obj = make_objective(name, **params)
        inputs = StepInputs(fwd, drafter, feats, obj, settings, num_anchors=anchors)
        return lambda step: block_step(inputs, on, step, False)

    def edr(max_anchors: int, sampler: str = "gradient", score_chunk: int | None = None, on=batch):
        obj = make_objective(
            "edr", mode=mode, max_anchors=max_anchors, greedy_temperature=0.5,
            anchor_sampler=sampler,
        )  # fmt: skip
        inputs = StepInputs(
            fwd, drafter, feats, obj, settings, mode=mode,
            stop_token_ids=target.stop_token_ids, score_chunk=score_chunk,
        )  # fmt: skip
        return lambda step: rounds_step(inputs, on, step, False)

    kind = "greedy beta 0.5" if mode == "greedy" else f"sampling T = {settings.temperature:g}"
    rows = {
        f"D-PACE @{args.anchors} anchors (the control)": block("dpace", args.anchors),
        f"D-PACE @every round start ({rows_per})": block("dpace", 4096),
        f"E2E {kind} @{args.anchors} anchors": block("e2e", args.anchors, greedy_temperature=0.5),
        f"EDR {kind}, every round start": edr(512),
        f"EDR {kind}, max_anchors 16": edr(16),
        f"EDR {kind}, max_anchors 32": edr(32),
        f"EDR {kind}, max_anchors 32 uniform": edr(32, "uniform"),
        f"EDR {kind}, max_anchors 64": edr(64),
        f"EDR {kind}, max_anchors 64 uniform": edr(64, "uniform"),
    }
    for chunk in args.score_chunks:
        rows[f"EDR {kind}, max_anchors 16, scoring {chunk} round starts per pass"] = edr(
            16, score_chunk=chunk
        )
    if args.tensor_sums:
        rows[f"EDR {kind}, max_anchors 16, scoring sums as tensor ops"] = with_tensor_sums(edr(16))
    if other is not None:
        rows[f"E2E {kind} @{args.anchors} anchors, {args.also_rollouts}"] = block(
            "e2e", args.anchors, on=other, greedy_temperature=0.5
        )
        rows[f"EDR {kind}, max_anchors 16, {args.also_rollouts}"] = edr(16, on=other)
    names = list(rows)

    bf16 = args.amp == "bf16"

    def timed(name: str, step: int) -> float:
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as training/loop.py
            out = rows[name](step)
        out.numerator.backward()
        return time.perf_counter() - t0

    for name in names:  # warm-up (numba compiles the recursions on first use)
        timed(name, 0)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    secs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        t = {n: timed(n, r + 1) for n in order}
        for n in names:
            secs[n].append(t[n])
            ratios[n].append(t[n] / t[names[0]])
    print(
        f"{len(rollouts)} {mode} rollouts of {args.rollouts}, median of {args.rounds} rounds"
        f", {args.amp}, "
        + (f"cached features {args.features}" if args.features else "online target")
    )
    print(
        f"| step | seconds | vs D-PACE @{args.anchors} | rounds' range |\n|---|---|---|---|"
    )  # the range: how far one round's ratio strays on this machine
    for n in names:
        lo, hi = min(ratios[n]), max(ratios[n])
        print(
            f"| {n} | {statistics.median(secs[n]):.3f} | {statistics.median(ratios[n]):.3f}x "
            f"| {lo:.2f}-{hi:.2f}x |"
        )
    if args.phases:
        profile_phases(rows, [names[0], names[2], names[4]], drafter, feats, fwd, bf16)


def with_tensor_sums(step):
    """`step` with the scoring pass's dense sums on the tensor-op backend (the GPU path)."""
    compiled = edr_acceptance.scores_with_gradient_moments

    def run(i):
        edr_acceptance.scores_with_gradient_moments = functools.partial(compiled, backend="torch")
        try:
            return step(i)
        finally:
            edr_acceptance.scores_with_gradient_moments = compiled

    return run


PHASES = {  # module -> public functions timed as phases
    block: ["sampling_targets", "overlap_with_logits"],
    rounds: ["score_round_starts", "sampling_target_rows"],
    proposal_scores: ["head_chunked_scores"],
    edr_package: ["sampling_scores_and_moments"],
}  # fmt: skip


def _labelled(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return run


def profile_phases(rows, names, drafter, feats, fwd, bf16: bool, steps: int = 3) -> None:
    """ms per step of each phase of the rows `names` (labels wrap the step's own calls)."""
    for module, fns in PHASES.items():
        for fn in fns:
            setattr(module, fn, _labelled(fn, getattr(module, fn)))
    feats.features = _labelled("target forward", feats.features)
    fwd.forward = _labelled("drafter forward (block objectives)", fwd.forward)
    for name in names:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(steps):
                drafter.zero_grad(set_to_none=True)
                with (
                    record_function("forward + objective"),
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
                ):
                    out = rows[name](100 + step)
                with record_function("backward"):
                    out.numerator.backward()
        phases = [e for e in prof.key_averages() if e.key in _LABELS]
        print(f"\n{name}: ms per step (phases nest: a pass includes the ones under it)")
        for e in sorted(phases, key=lambda e: -e.cpu_time_total):
            print(f"  {e.key:<40}{e.cpu_time_total / 1e3 / steps:9.1f}")


_LABELS = {
    "forward + objective", "backward", "target forward", "drafter forward (block objectives)",
    *(fn for fns in PHASES.values() for fn in fns),
}  # fmt: skip


if __name__ == "__main__":
    main()
