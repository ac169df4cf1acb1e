"""Drafter training tokens/s with the online target vs cached features, side by side.

Why: online training runs the frozen target over every sequence of every step only to
read a few hidden states; `blockdraft features` stores them once per rollout set and
`data.features=DIR` reads them back. What that buys depends on the target/drafter cost
ratio, so two shapes are timed in one run, each on the same batch and anchors:

- `tiny`: the demo's step (target 4 x 128, vocabulary 4,096; drafter 1 layer, block 8,
  64 anchors, 8 sequences of ~96 prompt + 128 response tokens);
- `gemma`: a Gemma-3-270M-shaped target (random weights: 18 layers, width 640, 262,144
  vocabulary) with configs/gemma-3-270m.yaml's drafter (2 layers, block 16, 32,768-token
  draft vocabulary); sequences and anchors scaled down to fit a CPU budget.

A step = features (target forward, or shard reads) + drafter forward/backward (D-PACE) +
AdamW step, exactly the loop's `block_step`. Rounds alternate the order of the two
sources; the factor is the median over rounds of time(online) / time(cached), in CPU
seconds of this process (tokens per CPU second), which a busy shared machine distorts
far less than wall time. The
one-off cost of writing the features (`write_features`, includes the disk write) is
printed as a multiple of one online step's target forward.

    python bench/train_features.py [--rounds 5] [--threads 1] [--shapes tiny gemma]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.data.feature_writer import plan_features, write_features
from blockdraft.data.rollouts.sampler import SamplingSettings
from blockdraft.data.rollouts.store import (
    FORMAT,
    VERSION,
    Rollout,
    encode_shard,
    sha256_bytes,
    target_fingerprint,
    write_atomic,
    write_manifest,
)
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.registry import make_objective
from blockdraft.targets.target import Target
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import CachedFeatures, OnlineTargetFeatures
from blockdraft.training.steps import StepInputs
from blockdraft.training.steps.block import block_step
from fixture_targets import make_shaped_target


def _clock() -> float:
    """CPU seconds of this process: the machine is shared, and wall time counts the waits
    for a core; with one intra-op thread CPU time is the step's compute."""
    return time.process_time()


@dataclass
class Shape:
    name: str
    batch: int
    prompt: int
    response: int
    anchors: int
    block: int
    drafter_layers: int
    draft_vocab: int | None


SHAPES = {
    "tiny": Shape("tiny", 8, 96, 128, 64, 8, 1, None),
    "gemma": Shape("gemma", 2, 64, 192, 64, 16, 2, 32768),
}


def make_target(name: str) -> Target:
    """Random weights at the real architecture and shape (`tests/random_targets.py`'s `SHAPES`)."""
    return make_shaped_target("tiny" if name == "tiny" else "gemma-3-270m")


def write_rollouts(directory: Path, target: Target, rows: list[Rollout]) -> None:
    """A one-shard rollout set on disk (what `blockdraft features` reads)."""
    directory.mkdir(parents=True)
    data = encode_shard(0, rows, 0)
    write_atomic(directory / "shard-00000.safetensors", data)
    shard = {"file": "shard-00000.safetensors", "first_row": 0, "rows": len(rows)}
    shard.update(bytes=len(data), sha256=sha256_bytes(data), response_tokens=0)
    write_manifest(
        directory,
        {
            "format": FORMAT,
            "version": VERSION,
            "target": {"name": target.name, "fingerprint": target_fingerprint(target)},
            "settings": SamplingSettings(temperature=0.0).to_dict(),
            "store_topk": 0,
            "complete": True,
            "shards": [shard],
        },
    )


def bench_shape(shape: Shape, rounds: int, root: Path) -> None:
    target = make_target(shape.name)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(shape.batch):
        prompt = torch.randint(3, target.vocab_size, (shape.prompt,), generator=gen)
        resp = torch.randint(3, target.vocab_size, (shape.response,), generator=gen)
        rows.append(Rollout(f"r{i}", prompt, resp, torch.zeros(shape.response)))
    write_rollouts(root / shape.name / "rollouts", target, rows)
    t0 = _clock()
    plan = plan_features(target, root / shape.name / "rollouts", root / shape.name / "features")
    write_features(target, plan, batch_size=shape.batch, progress=False)
    write_s = _clock() - t0
    cached = CachedFeatures.open(
        root / shape.name / "features",
        target=target,
        rollout_dir=root / shape.name / "rollouts",
        rollouts=rows,
        max_seq_len=4096,
    )
    sources = {"online": OnlineTargetFeatures(target), "cached": cached}

    torch.manual_seed(0)
    drafter = BlockDrafter(
        DrafterConfig.for_target(
            target,
            num_layers=shape.drafter_layers,
            block_size=shape.block,
            draft_vocab_size=shape.draft_vocab,
        )
    )
    if shape.draft_vocab:
        drafter.set_draft_vocab(torch.arange(shape.draft_vocab))
    drafter.bind_target(target)
    fwd = DraftForward(drafter)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    objective = make_objective("dpace", alpha=0.5)
    batch = collate(rows, list(range(len(rows))), 0, 4096)
    settings = SamplingSettings(temperature=0.0)

    def step(name: str, step_index: int) -> float:
        opt.zero_grad(set_to_none=True)
        t = _clock()
        inputs = StepInputs(
            fwd, drafter, sources[name], objective, settings, num_anchors=shape.anchors
        )
        out = block_step(inputs, batch, step_index, False)
        out.numerator.backward()
        opt.step()
        return _clock() - t

    step("online", 0), step("cached", 0)  # warm-up
    times: dict[str, list[float]] = {"online": [], "cached": []}
    ratios = []
    for r in range(rounds):
        order = ("online", "cached") if r % 2 == 0 else ("cached", "online")
        t = {name: step(name, r + 1) for name in order}
        for name in order:
            times[name].append(t[name])
        ratios.append(t["online"] / t["cached"])
    t = _clock()
    OnlineTargetFeatures(target).features(batch)
    forward_s = _clock() - t
    tokens = batch.num_tokens
    on, ca = statistics.median(times["online"]), statistics.median(times["cached"])
    print(
        f"{shape.name:6s} ({shape.batch} seq x {shape.prompt}+{shape.response} tokens, "
        f"{shape.anchors} anchors, block {shape.block}, drafter {shape.drafter_layers} layer(s), "
        f"draft vocab {shape.draft_vocab or target.vocab_size}, features {target.feature_size})"
    )
    print(
        f"  online {tokens / on:8.0f} tok/s ({on:.3f} s/step)   cached {tokens / ca:8.0f} tok/s "
        f"({ca:.3f} s/step)   cached/online = {statistics.median(ratios):.2f}x "
        f"(median of {rounds})"
    )
    print(
        f"  target forward alone {forward_s:.3f} s ({forward_s / on:.0%} of an online step: "
        f"skipping it can give at most {on / max(on - forward_s, 1e-9):.2f}x); "
        f"writing the features once took {write_s:.2f} s = {write_s / forward_s:.1f} forwards, "
        f"{plan.total_bytes / 1e6:.1f} MB ({plan.header['dtype']})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"drafter training step, online target vs cached features ({args.threads} thread(s))")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            bench_shape(SHAPES[name], args.rounds, Path(tmp))


if __name__ == "__main__":
    main()
