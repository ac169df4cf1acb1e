"""The training benches run: each reaches into the training step's internals, so a refactor
of a step's signature breaks them silently unless something runs them (one did:
`bench/train_step.py --part objectives` once passed a target where the step takes stop
ids). Smallest sizes, one round: this checks that they run and print their table, never
their numbers (speed claims stay in bench/, run by hand)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.targets.registry import load_target
from clikit import prompts, save_local_model, save_random_drafter

REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _ratios(out: str, pattern: str) -> list[float]:
    found = [float(x) for x in re.findall(pattern, out)]
    assert found and all(math.isfinite(x) and x > 0 for x in found), out
    return found


@pytest.mark.slow
def test_train_step_objectives_bench_runs() -> None:
    out = _run("bench/train_step.py", "--part", "objectives", "--rounds", "1")
    assert "edr scoring pass @sub" in out and "edr/gradient @sub" in out
    _ratios(out, r"(\d+\.\d+)x")


@pytest.mark.slow
def test_edr_finetune_cost_bench_runs(tmp_path: Path) -> None:
    model = save_local_model(tmp_path / "target")
    target = load_target(str(model))
    rollouts = tmp_path / "rollouts"
    settings = SamplingSettings(temperature=1.0, max_new_tokens=24, seed=0)
    generate_rollouts(target, prompts(2), rollouts, settings, batch_size=2, progress=False)
    drafter = save_random_drafter(target, tmp_path / "drafter", block_size=4)
    out = _run(
        "bench/edr_finetune_cost.py", "--target", str(model), "--drafter", str(drafter),
        "--rollouts", str(rollouts), "--batch", "2", "--rounds", "1", "--tensor-sums",
    )  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert any("scoring sums as tensor ops" in row for row in rows), out
    assert len(rows) == 10, out  # the control, 8 E2E / D-PACE / EDR rows, the tensor-sums row
    _ratios("\n".join(rows), r"\| (\d+\.\d+)x \|")
