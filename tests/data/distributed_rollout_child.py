"""One rank of the torchrun rollout test: writes a small rollout set, optionally freezing.

Usage (under torchrun): distributed_rollout_child.py OUT_DIR MARKER PAUSE_RANK PAUSE_AFTER

Rank PAUSE_RANK (-1: none), once it has finished PAUSE_AFTER shards (written and recorded
in its part file), writes its pid to MARKER and sleeps, so the test can `kill -9` it in
the middle of its next shard. The test imports the sizes and prompts from here.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from blockdraft.data.prompt_type import Prompt

SETTINGS = dict(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=8, seed=321)
BATCH_SIZE = 2
SHARD_SIZE = 2
NUM_PROMPTS = 12
STORE_TOPK = 2


def make_prompts() -> list[Prompt]:
    words = ["def", "class", "import", "for", "return", "print", "self", "range", "if", "x"]
    return [
        Prompt(
            f"d{i}",
            " ".join(words[(i * j + i) % len(words)] for j in range(1, 2 + i % 6)),
            None,
            "child",
        )
        for i in range(NUM_PROMPTS)
    ]


def main() -> None:
    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    pause_rank, pause_after = int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    import blockdraft.data.rollouts.generate as rollouts
    from blockdraft.data.rollouts.distributed import init_from_env
    from blockdraft.data.rollouts.sampler import SamplingSettings

    # run as a script, the child sees only its own folder on sys.path: tests/ holds the fixture
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from random_targets import make_random_target

    ctx, _, created = init_from_env("cpu")
    original = rollouts._generate_shard
    calls = {"n": 0}

    def pausing_generate_shard(*args, **kwargs):
        if ctx.rank == pause_rank and calls["n"] == pause_after:
            marker.write_text(str(os.getpid()))
            time.sleep(600)
        calls["n"] += 1
        return original(*args, **kwargs)

    rollouts._generate_shard = pausing_generate_shard
    target = make_random_target("qwen3")
    rollouts.generate_rollouts(
        target,
        make_prompts(),
        out,
        SamplingSettings(**SETTINGS),
        batch_size=BATCH_SIZE,
        shard_size=SHARD_SIZE,
        store_topk=STORE_TOPK,
        progress=False,
    )
    if created:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
