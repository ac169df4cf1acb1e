"""A new objective is one module: its parameters, its loss, one `register_objective` call.

The module below is written to a temporary directory and imported; nothing else is edited.
The trainer must then accept its YAML keys, check them, hand them to the loss, record them
in run.yaml, and train with it: the step's loss must change with the parameter.
"""

from __future__ import annotations

import importlib
import math
import textwrap

import pytest
import yaml
from trainkit import make_config, read_metrics

from blockdraft.objectives.registry import OBJECTIVES
from blockdraft.training import train
from blockdraft.training.config import ConfigError

TOY = '''
from dataclasses import dataclass

from blockdraft.objectives import Objective, ObjectiveParams, param, register_objective
from blockdraft.objectives.losses import LossOutput
from blockdraft.objectives.params import positive_number


@dataclass(frozen=True)
class PowerParams(ObjectiveParams):
    power: float = param(1.0, positive_number)  # the NLL of each proposal, raised to this


class PowerNLL(Objective):
    """mean over real proposals of (-log q) ** power."""

    Params = PowerParams

    def loss(self, logq, mask, **unused):
        w = mask.to(logq.dtype)
        loss = (w * (-logq).clamp_min(0) ** self.params.power).sum() / w.sum()
        return LossOutput(loss, w, {"weight_sum": float(w.sum())})


register_objective("power-nll", PowerNLL)
'''


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "toy_objective.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("blockdraft.objectives.registry.OBJECTIVES", dict(OBJECTIVES))
    return importlib.import_module("toy_objective")


def _first_loss(target, rollout_dirs, run, power):
    objective = {"name": "power-nll", "power": power}
    optim = {"max_steps": 1, "warmup_steps": 0}
    cfg = make_config(run, rollout_dirs, objective=objective, optim=optim, eval={"at_start": False})
    train(cfg, target=target)
    return [m["loss"] for m in read_metrics(run) if "loss" in m][0]


def test_a_planted_objective_trains_with_its_own_parameters(
    toy_module, target, rollout_dirs, tmp_path
):
    one = _first_loss(target, rollout_dirs, tmp_path / "p1", 1.0)
    three = _first_loss(target, rollout_dirs, tmp_path / "p3", 3.0)
    assert math.isfinite(one) and math.isfinite(three)
    assert three > one > 1.0  # NLL > 1 at the start, so its cube is larger: the power arrived
    recorded = yaml.safe_load((tmp_path / "p3" / "run.yaml").read_text())["objective"]
    assert recorded == {"name": "power-nll", "mode": "auto", "power": 3.0}
    with pytest.raises(ConfigError, match="objective.power: power must be a positive"):
        make_config(tmp_path / "bad", rollout_dirs, objective={"name": "power-nll", "power": 0})
