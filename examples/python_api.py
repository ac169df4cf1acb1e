"""The whole pipeline from Python on the embedded `tiny` target, on a CPU in seconds.

Rollouts of a few prompts -> a drafter trained for a few steps -> its exact offline MAL
next to prompt lookup (`ngram`) -> a serving-ready export. Everything is written under
the current directory (`python examples/python_api.py` from anywhere). A few steps on a
few prompts train nothing useful: docs/training.md has the real recipes.
"""

from pathlib import Path

import blockdraft

HERE = Path(__file__).resolve().parent

target = blockdraft.load_target("tiny", device="cpu", progress=False)

# greedy rollouts: what the target answers, token by token
train_set = blockdraft.generate_rollouts(
    target, str(HERE / "prompts.jsonl"), "rollouts/train",
    temperature=0, max_new_tokens=32, limit=8, progress=False,
)  # fmt: skip
heldout = blockdraft.generate_rollouts(
    target, str(HERE / "heldout.jsonl"), "rollouts/heldout",
    temperature=0, max_new_tokens=32, limit=4, progress=False,
)  # fmt: skip
print(f"{len(train_set)} training rollouts, {len(heldout)} held out")

final = blockdraft.train(
    HERE.parent / "configs" / "tiny.yaml",
    {
        "run_dir": "runs/quick",
        "target.name": "tiny",
        "device": "cpu",
        "data.train_rollouts": "rollouts/train",
        "data.eval_rollouts": "rollouts/heldout",
        "optim.max_steps": 3,
        "optim.batch_size": 4,
        "num_anchors": 8,
        "eval.at_start": False,
        "logging.progress": False,
        "logging.tensorboard": False,
    },
    target=target,
    overwrite=True,
)
print(f"trained: {final}")

result = blockdraft.evaluate(target, ["ngram", "runs/quick"], heldout, n_boot=200, progress=False)
for d in result["benchmarks"][0]["drafters"]:
    lo, hi = d["mal_ci95"]
    print(f"{d['name']:>6}: MAL {d['mal']:.3f} [{lo:.3f}, {hi:.3f}]")

gain = blockdraft.compare(target, ["ngram", "runs/quick"], heldout, n_boot=200, progress=False)
row = gain["comparisons"][0]
print(f"{row['b']} vs {row['a']}: MAL gain {row['mal_gain']:+.3f}")

out = blockdraft.export(final, "export/quick", overwrite=True)
print(f"exported: {out}")
