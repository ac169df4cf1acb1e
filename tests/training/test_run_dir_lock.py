"""Run directories (issue 29): one `train` per run_dir at a time (a second is refused naming
the first's pid, and writes nothing), never a run inside a rollout set, and free disk
checked before a checkpoint is written."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
from trainkit import make_config

from blockdraft.errors import BlockdraftError
from blockdraft.training import step_checkpoint as ckpt
from blockdraft.training.trainer import train
from diskkit import full_disk_for
from lockkit import hold_lock, kill


def _tree(path):
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_second_train_into_a_run_dir_is_refused_naming_the_first(target, rollout_dirs, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(run, rollout_dirs, optim={"max_steps": 2})
    first = hold_lock(run, tmp_path / "locked")  # a `train` still running there
    try:
        with pytest.raises(ckpt.RunDirError, match=rf"{run}: .*\(pid {first.pid}:"):
            train(cfg, target=target)
        with pytest.raises(ckpt.RunDirError, match=rf"\(pid {first.pid}:"):
            train(cfg, target=target, overwrite=True)  # --overwrite does not break in either
        assert [p.name for p in run.iterdir()] == [".blockdraft.lock"]  # nothing written
    finally:
        kill(first)
    train(cfg, target=target)  # the killed run's lock file is taken over
    assert (run / "final").is_dir() and not (run / ".blockdraft.lock").exists()


def test_a_run_never_writes_into_a_rollout_set(target, rollout_dirs, tmp_path):
    r = tmp_path / "r"
    shutil.copytree(rollout_dirs["greedy"], r)
    before = _tree(r)
    for run, overwrite in ((r, False), (r, True), (r / "run", True)):
        cfg = make_config(run, rollout_dirs, optim={"max_steps": 2})
        with pytest.raises(ckpt.RunDirError, match="a rollout set, not a run directory"):
            train(cfg, target=target, overwrite=overwrite)
    assert _tree(r) == before and not (r / "run").exists()


def test_checkpoint_refused_when_the_disk_is_too_small(target, rollout_dirs, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**12, 10**12 - 1000, 1000))
    run = tmp_path / "run"
    cfg = make_config(run, rollout_dirs, optim={"max_steps": 2}, checkpoint={"save_every": 2})
    with pytest.raises(BlockdraftError, match=r"not enough free disk space .* needs .* free"):
        train(cfg, target=target)
    assert not list((run / "checkpoints").glob("*")) and not (run / "final").exists()


def test_full_disk_while_writing_run_yaml_names_the_file(
    target, rollout_dirs, tmp_path, monkeypatch
):
    from blockdraft.errors import os_error_message

    run = tmp_path / "run"
    full_disk_for(monkeypatch, ".run.yaml.tmp")
    with pytest.raises(OSError) as info:
        train(make_config(run, rollout_dirs, optim={"max_steps": 2}), target=target)
    assert os_error_message(info.value) == f"{run / 'run.yaml'}: the disk is full"
    assert not list(run.glob(".*.tmp"))
