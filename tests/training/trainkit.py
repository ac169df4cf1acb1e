"""Helpers for training tests: a learnable micro-setting (a sharpened random target).

A random-weight target's text is unpredictable, so nothing could be learned from it. With
its (tied) embedding/LM head scaled up, the random network becomes confident and its
greedy or T=0.7 continuations are highly regular (long runs of the same token with a few
switches), which a 1-layer drafter learns within a few dozen steps: exactly what the
"training must improve held-out MAL" tests need, in seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from blockdraft.data.prompt_type import Prompt
from blockdraft.training import config_from_dict
from random_targets import make_random_target

HEAD_SCALE = 8.0
MAX_NEW_TOKENS = 24


def learnable_target():
    """Deterministic: every process that calls this gets the same target (DDP tests)."""
    target = make_random_target("qwen3", hidden_size=64, num_layers=4, seed=0)
    target.layer_ids = [1]  # pinned: the learning thresholds were calibrated on this setting
    with torch.no_grad():
        target.lm_head.weight.mul_(HEAD_SCALE)
    return target


def prompts_for(prefix: str, n: int) -> list[Prompt]:
    """Distinct prompts that end in one of four shared tails, so that held-out prompts
    lead to the same kinds of continuations as the training prompts."""
    tails = ["return x + 1", "print(i * i)", "self.x = x", "import os"]
    return [
        Prompt(
            id=f"{prefix}{i}",
            text=f"# {prefix} case {i}\n{tails[i % 4]}",
            messages=None,
            source="test",
        )
        for i in range(n)
    ]


def make_config(run_dir: Path, rollouts: dict[str, Path], mode: str = "greedy", **sections):
    """A small fast config; `sections` are merged into the defaults (nested dicts)."""
    base = {
        "run_dir": str(run_dir),
        "seed": 0,
        "num_anchors": 8,
        "data": {"train_rollouts": str(rollouts[mode]), "eval_split": 0.34, "max_seq_len": 64},
        "drafter": {"num_layers": 1, "block_size": 5},
        "objective": {"name": "uniform"},
        "optim": {"lr": 1e-2, "batch_size": 8, "max_steps": 12, "warmup_steps": 2},
        "eval": {"every": 0, "max_rollouts": 8},
        "checkpoint": {"save_every": 0},
        "logging": {"every": 4, "progress": False, "tensorboard": False},
    }
    for key, val in sections.items():
        if isinstance(val, dict):
            base.setdefault(key, {}).update(val)
        else:
            base[key] = val
    if base["objective"]["name"] == "edr":  # a parameter of EDR's only
        base["objective"].setdefault("max_anchors", 16)
    return config_from_dict(base)


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def ddp_worker(rank: int, world_size: int, port: int, cfg_dict: dict) -> None:
    """One torchrun-like rank (spawned by the DDP test): env vars, then `train`."""
    import os

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
    )
    torch.set_num_threads(1)
    from blockdraft.training import train

    train(config_from_dict(cfg_dict), target=learnable_target())


def random_step_batch(lengths: list[int]):  # type: ignore[no-untyped-def]
    """(target, 1-layer block-4 drafter, batch) of random rollouts with the given response
    lengths (5-token prompts), for micro-step tests on a tiny random Qwen3 target."""
    from blockdraft.data.rollouts.store import Rollout
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.training.batching import collate

    torch.manual_seed(0)
    target = make_random_target("qwen3", hidden_size=32, num_layers=2, num_heads=2)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
    drafter.bind_target(target)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i, n in enumerate(lengths):
        prompt = torch.randint(3, target.vocab_size, (5,), generator=gen)
        resp = torch.randint(3, target.vocab_size, (n,), generator=gen)
        rows.append(Rollout(f"r{i}", prompt, resp, torch.full((n,), -1.0)))
    return target, drafter, collate(rows, list(range(len(rows))), 0, 4096)


def draft_space_step_setup():  # type: ignore[no-untyped-def]
    """(target, drafter, batch) for the sampling-step tests in a reduced draft vocabulary:
    `random_step_batch([14, 11])`, stop tokens 1 (inside the draft vocabulary) and 2
    (outside), and labels outside it and on both stop tokens."""
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    target, _, batch = random_step_batch([14, 11])
    target.stop_token_ids = [1, 2]
    keep = torch.tensor(sorted({*range(3, target.vocab_size, 3), 1}))
    torch.manual_seed(0)
    config = DrafterConfig.for_target(
        target, num_layers=1, block_size=4, draft_vocab_size=keep.numel()
    )
    drafter = BlockDrafter(config).bind_target(target)
    drafter.set_draft_vocab(keep)
    ids = batch.input_ids
    ids[0, 8], ids[0, 10], ids[1, 7] = 1, 2, 4  # 4 is not in the draft vocabulary
    return target, drafter, batch


def every_round_start(batch):  # type: ignore[no-untyped-def]
    """`[B, A]` anchors of every round start of each rollout in `batch` (-1 = padding)."""
    from blockdraft.data.anchors import round_start_anchors
    from blockdraft.training.steps.anchored_blocks import pad_anchor_lists

    return pad_anchor_lists(
        [
            round_start_anchors(int(p), int(n))
            for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
        ]
    )


def step_inputs(target, drafter, objective, settings, **fields):  # type: ignore[no-untyped-def]
    """`StepInputs` of a one-process step of `drafter` on `target`'s online features;
    `fields` override or add to them (fwd, features, seed, mode, score_chunk, ...)."""
    from blockdraft.training.draft_forward import DraftForward
    from blockdraft.training.feature_sources import OnlineTargetFeatures
    from blockdraft.training.steps import StepInputs

    fields.setdefault("fwd", DraftForward(drafter))
    fields.setdefault("features", OnlineTargetFeatures(target))
    fields.setdefault("stop_token_ids", target.stop_token_ids)
    return StepInputs(drafter=drafter, objective=objective, settings=settings, **fields)


def rounds_batch(fwd, stops, tout, batch, settings, mode):  # type: ignore[no-untyped-def]
    """The `RoundsBatch` a scoring pass reads (no step-wide target rows, no head cap)."""
    from blockdraft.training.steps.rounds import RoundsBatch

    return RoundsBatch(fwd, stops, tout, batch, settings, mode)


def wrapped_forward_class():  # type: ignore[no-untyped-def]
    """A `DraftForward` subclass: the steps treat it as a DDP/FSDP wrapper (everything
    through `forward`, `[N, K, V]` logits), the reference for the unwrapped fast paths."""
    from blockdraft.training.draft_forward import DraftForward

    class Wrapped(DraftForward):
        pass

    return Wrapped


def target_output(target, batch):  # type: ignore[no-untyped-def]
    """The target's logits and features over a padded batch."""
    return target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
