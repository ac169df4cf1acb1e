"""Child process for the kill -9 resume test: writes a small rollout set, optionally freezing.

Usage: python rollout_writer_child.py OUT_DIR MARKER PAUSE_SHARD

With PAUSE_SHARD >= 0 the writer, once it has generated the first batch of shard
PAUSE_SHARD (so earlier shards are finished and listed), creates MARKER and sleeps; the
test then kills it with SIGKILL, which is a crash in the middle of a shard.
The test imports `make_prompts`, `SETTINGS` and the sizes from here so both sides agree.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from blockdraft.data.prompt_type import Prompt

SETTINGS = dict(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=10, seed=123)
BATCH_SIZE = 2
SHARD_SIZE = 3
NUM_PROMPTS = 10
STORE_TOPK = 3


def make_prompts() -> list[Prompt]:
    words = ["def", "class", "import", "for", "return", "print", "self", "range", "if", "x"]
    return [
        Prompt(
            f"p{i}",
            " ".join(words[(i * j) % len(words)] for j in range(1, 3 + i % 5)),
            None,
            "child",
        )
        for i in range(NUM_PROMPTS)
    ]


def main() -> None:
    out, marker, pause_shard = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    import blockdraft.data.rollouts.generate as rollouts
    from blockdraft.data.rollouts.sampler import SamplingSettings

    # run as a script, the child sees only its own folder on sys.path: tests/ holds the fixture
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from random_targets import make_random_target

    original = rollouts.generate_batch
    calls = {"n": 0}
    batches_per_shard = -(-SHARD_SIZE // BATCH_SIZE)

    def pausing_generate_batch(*args, **kwargs):
        result = original(*args, **kwargs)
        calls["n"] += 1
        if pause_shard >= 0 and calls["n"] == pause_shard * batches_per_shard + 1:
            marker.write_text("paused")
            time.sleep(600)
        return result

    rollouts.generate_batch = pausing_generate_batch
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


if __name__ == "__main__":
    main()
