"""`amp: bf16` trains on a CPU too (the bf16 matrix units of recent CPUs make a step ~2x
faster), while `amp: auto` keeps the CPU in fp32 so a run repeats across machines. Checked
against the fp32 run from the same start: the first loss agrees to bf16 precision, the
weights stay fp32, and the drafter learns as much."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from trainkit import make_config, read_metrics

from blockdraft.training import train
from blockdraft.training.builders import amp_dtype

CPU = torch.device("cpu")


def test_amp_resolves_per_device():
    cfg = make_config("unused", {"greedy": "unused"})
    for amp, cpu, cuda in [
        ("auto", None, torch.bfloat16),
        ("off", None, None),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ]:
        cfg.amp = amp
        assert amp_dtype(cfg, CPU) is cpu and amp_dtype(cfg, torch.device("cuda", 0)) is cuda


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter", [{}, {"arch": "dflash2", "selector_rank": 8, "selector_top_k": 6}]
)
def test_bf16_autocast_trains_on_cpu_like_fp32(drafter, target, rollout_dirs, tmp_path):
    runs = {}
    for amp in ("auto", "bf16"):
        cfg = make_config(
            tmp_path / amp,
            rollout_dirs,
            amp=amp,
            eval={"every": 12},
            objective={"name": "dpace"},
            drafter=drafter,
        )
        final = train(cfg, target=target)
        weights = load_file(final / "model.safetensors")
        assert all(w.dtype == torch.float32 for w in weights.values()), amp
        runs[amp] = read_metrics(cfg.run_dir)
    losses = {a: [m["loss"] for m in r if m["event"] == "train"] for a, r in runs.items()}
    assert losses["bf16"][0] == pytest.approx(losses["auto"][0], rel=0.02)
    assert losses["bf16"][0] != losses["auto"][0]  # autocast did run the step in bf16
    evals = {a: [m["eval_mal"] for m in r if m["event"] == "eval"] for a, r in runs.items()}
    assert evals["bf16"][0] == pytest.approx(evals["auto"][0], rel=0.02)  # same start
    assert evals["bf16"][-1] > evals["bf16"][0] + 0.2, evals
    assert evals["bf16"][-1] > evals["auto"][-1] - 0.1, evals
