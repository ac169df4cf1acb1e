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


def _interrupted(cfg, target, monkeypatch, at_step):
    real_step = loop.train_step

    def crashing_step(parts, step, want_acc):
        if step == at_step:
            raise KeyboardInterrupt
        return real_step(parts, step, want_acc)

    monkeypatch.setattr(loop, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, target=target)
    monkeypatch.setattr(loop, "train_step", real_step)


def test_resume_with_another_lr_trains_with_it_and_says_so(
    target, rollout_dirs, tmp_path, monkeypatch, capsys
):
    """run.yaml records the new `optim.lr`, so the steps after the checkpoint must use it:
    the logged lr of each later step is the new lr times the schedule factor the
    uninterrupted run logged at that step (warm-up and cosine from the config)."""
    sections = dict(
        objective={"name": "dpace"},
        checkpoint={"save_every": 3, "keep_last": 2},
        eval={"at_start": False},
        logging={"every": 1},
    )
    optim = {"max_steps": 6, "lr": 1e-2}
    straight = train(
        make_config(tmp_path / "a", rollout_dirs, optim=optim, **sections), target=target
    )
    cfg = make_config(tmp_path / "b", rollout_dirs, optim=optim, **sections)
    _interrupted(cfg, target, monkeypatch, at_step=4)
    capsys.readouterr()
    faster = make_config(tmp_path / "b", rollout_dirs, optim={**optim, "lr": 3e-2}, **sections)
    resumed = train(faster, target=target, resume=True)
    assert "optim.lr 0.01 -> 0.03" in capsys.readouterr().out

    def lrs(run):
        return {m["step"]: m["lr"] for m in read_metrics(run) if m["event"] == "train"}

    before, after = lrs(tmp_path / "a"), lrs(tmp_path / "b")
    assert sorted(after) == list(range(1, 7))
    for step in range(1, 4):
        assert after[step] == before[step]
    for step in range(4, 7):
        assert after[step] == pytest.approx(3 * before[step], rel=1e-12)
    a, b = _weights(straight), _weights(resumed)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_thread_count_warns(target, rollout_dirs, tmp_path, capsys):
    from blockdraft.training.resume import threads_note

    cfg = make_config(
        tmp_path / "r", rollout_dirs, optim={"max_steps": 2}, checkpoint={"save_every": 1}
    )
    threads = torch.get_num_threads()
    train(cfg, target=target)
    step = tmp_path / "r" / "checkpoints" / "step-2"
    assert f"cpu_threads: {threads}" in (step / "run.yaml").read_text()
    assert threads_note(step, threads, "cpu") is None
    note = threads_note(step, threads + 1, "cpu")
    assert note.startswith("warning:") and f"--threads {threads}" in note and str(step) in note
    assert threads_note(step, threads + 1, "cuda") is None


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
