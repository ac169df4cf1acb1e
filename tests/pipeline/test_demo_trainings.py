"""The demo's trainings side by side (`run_trainings`): each in its own process with a
fixed thread count, giving exactly the drafters the same trainings give one after another
in-process, reporting each as it ends, raising a worker's error in the caller, and keeping
freed memory in the worker as the training CLI does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from blockdraft import heap
from blockdraft.data.prompt_type import Prompt
from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.errors import BlockdraftError
from blockdraft.pipeline import demo
from blockdraft.targets.registry import load_target
from blockdraft.training.config import config_from_dict
from random_targets import make_random_target


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-trainings")
    random = make_random_target("qwen3", num_layers=4)
    random.model.save_pretrained(root / "target")
    random.tokenizer.save_pretrained(root / "target")
    target = load_target(str(root / "target"))
    prompts = [
        Prompt(id=f"p{i}", text=f"def f{i}(x):\n    return", messages=None, source="t")
        for i in range(12)
    ]
    settings = SamplingSettings(temperature=0.0, max_new_tokens=16, seed=0)
    generate_rollouts(target, prompts, root / "rollouts", settings, batch_size=12, progress=False)
    return root, target


def _config(root, runs, name, objective):
    return config_from_dict(
        {
            "run_dir": str(runs / name),
            "seed": 0,
            "device": "cpu",
            "num_anchors": 8,
            "target": {"name": str(root / "target")},
            "data": {
                "train_rollouts": str(root / "rollouts"),
                "eval_split": 0.25,
                "max_seq_len": 64,
            },
            "drafter": {"num_layers": 1, "block_size": 4},
            "objective": {"name": objective},
            "optim": {"lr": 1e-2, "batch_size": 4, "max_steps": 6, "warmup_steps": 1},
            "eval": {"every": 0},
            "checkpoint": {"save_every": 0},
            "logging": {"progress": False, "tensorboard": False},
        }
    )


def _weights(run_dir):
    return load_file(run_dir / "final" / "model.safetensors")


@pytest.mark.slow
def test_side_by_side_equals_one_after_another(setting, monkeypatch):
    root, target = setting
    done: dict[str, list[int]] = {"parallel": [], "serial": []}
    for how in ("parallel", "serial"):
        if how == "serial":
            monkeypatch.setattr(demo, "_usable_cores", lambda: 1)
        else:
            monkeypatch.setattr(demo, "_usable_cores", lambda: 2)
        jobs = [(_config(root, root / how, n, n), False) for n in ("uniform", "dpace")]
        demo.run_trainings(target, jobs, on_done=done[how].append)
    assert sorted(done["parallel"]) == sorted(done["serial"]) == [0, 1]
    for name in ("uniform", "dpace"):
        a, b = _weights(root / "parallel" / name), _weights(root / "serial" / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    u, d = _weights(root / "parallel" / "uniform"), _weights(root / "parallel" / "dpace")
    assert any(not torch.equal(u[k], d[k]) for k in u)  # two different trainings, not one


@pytest.mark.slow
def test_a_failing_worker_raises_in_the_caller(setting, monkeypatch):
    root, target = setting
    monkeypatch.setattr(demo, "_usable_cores", lambda: 2)
    bad = _config(root, root / "bad", "dpace", "dpace")
    bad.data.train_rollouts = str(root / "no-such-rollouts")
    good = _config(root, root / "bad", "uniform", "uniform")
    done: list[int] = []
    with pytest.raises(BlockdraftError, match="no-such-rollouts"):
        demo.run_trainings(target, [(bad, False), (good, False)], on_done=done.append)
    assert 0 not in done


# A fresh interpreter starts with glibc's malloc defaults, as a spawned worker does; the
# worker function runs with `train` replaced by a probe of resident memory after freeing a
# 256 MB tensor (kept only if the worker asked malloc to keep freed memory).
WORKER_PROBE = """
import torch
from blockdraft.pipeline import demo

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

def probe(cfg, resume, bar_position):
    base = rss_mb()
    x = torch.ones(64 << 20)
    del x
    return str(rss_mb() - base)

demo.train = probe
print(demo._train_in_process(None, False, 0))
"""


@pytest.mark.skipif(heap._libc() is None, reason="malloc is not glibc's")
def test_a_worker_keeps_freed_memory_like_the_training_cli():
    out = subprocess.run(
        [sys.executable, "-c", WORKER_PROBE], capture_output=True, text=True, check=True
    )
    assert float(out.stdout.split()[-1]) > 192, out.stdout
