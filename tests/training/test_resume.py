"""Checkpoints: exact resume, NaN stop keeping the last good checkpoint, refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from trainkit import make_config, read_metrics

import blockdraft.training.loop as loop
from blockdraft.training import ConfigError, steps, train
from blockdraft.training.loop import NonFiniteLossError


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_interrupted_and_resumed_run_matches_uninterrupted(
    target, rollout_dirs, tmp_path, monkeypatch
):
    sections = dict(
        objective={"name": "dpace"},
        optim={"max_steps": 8},
        checkpoint={"save_every": 3, "keep_last": 2},
        eval={"at_start": False},
        logging={"every": 1},
    )
    straight = train(make_config(tmp_path / "a", rollout_dirs, "greedy", **sections), target=target)

    cfg = make_config(tmp_path / "b", rollout_dirs, "greedy", **sections)
    real_step = loop.train_step

    def crashing_step(parts, step, want_acc):
        if step == 5:  # after the step-3 checkpoint, before step-6
            raise KeyboardInterrupt
        return real_step(parts, step, want_acc)

    monkeypatch.setattr(loop, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, target=target)
    monkeypatch.setattr(loop, "train_step", real_step)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-3"]
    with pytest.raises(Exception, match="--resume"):
        train(cfg, target=target)  # refuses to silently restart over existing checkpoints
    resumed = train(cfg, target=target, resume=True)

    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [m["step"] for m in read_metrics(cfg.run_dir) if m["event"] == "train"]
    assert steps == list(range(1, 9))  # superseded events of the crashed run were moved aside
    assert (tmp_path / "b" / "run.yaml").read_text().count("git_sha") == 1
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert kept == ["step-6", "step-8"]  # keep_last=2
    for d in ("final", "checkpoints/step-8"):
        assert {
            "config.json",
            "model.safetensors",
            "trainer_state.pt",
            "trainer_state.json",
            "run.yaml",
        } <= {p.name for p in (tmp_path / "b" / d).iterdir()}


def test_nan_loss_stops_and_keeps_last_good_checkpoint(target, rollout_dirs, tmp_path, monkeypatch):
    cfg = make_config(
        tmp_path / "run",
        rollout_dirs,
        "greedy",
        optim={"max_steps": 6},
        checkpoint={"save_every": 2},
        eval={"at_start": False},
    )
    real = steps.block_step

    def poisoned(inputs, batch, step, want_acc):
        out = real(inputs, batch, step, want_acc)
        if step == 2:  # the third optimizer step
            out.numerator = out.numerator * float("nan")
        return out

    monkeypatch.setattr(steps, "block_step", poisoned)  # what `micro_step_for` hands out
    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, target=target)
    msg = str(err.value)
    assert "step 3" in msg and "step-2" in msg
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors").is_file()
    assert not (tmp_path / "run" / "final").exists()


def test_mode_must_match_rollouts(target, rollout_dirs, tmp_path):
    cfg = make_config(
        tmp_path / "run", rollout_dirs, "greedy", objective={"name": "e2e", "mode": "sampling"}
    )
    with pytest.raises(ConfigError, match="objective.mode"):
        train(cfg, target=target)
