"""Run directories: nothing of an earlier run is replaced unasked, `--resume` uses the newest
*valid* checkpoint, leftovers of killed writes are cleaned, write failures are one line
(issue 16: F4, F5, F7, F1-resume, minor items), and the CLI's closing line."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from trainkit import make_config

from blockdraft.errors import os_error_message
from blockdraft.training import step_checkpoint as ckpt
from blockdraft.training.trainer import train
from clikit import make_rollouts, one_line_error, run_cli, save_local_model

REPO = Path(__file__).resolve().parents[2]


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_second_fresh_run_is_refused_and_overwrite_replaces(target, rollout_dirs, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(run, rollout_dirs, optim={"max_steps": 2}, checkpoint={"save_every": 0})
    train(cfg, target=target)
    before = _tree(run)
    with pytest.raises(ckpt.RunDirError, match="already holds a run .*--overwrite"):
        train(cfg, target=target)
    with pytest.raises(ckpt.RunDirError, match="no valid step checkpoint"):
        train(cfg, target=target, resume=True)  # save_every=0: nothing to resume from
    assert _tree(run) == before  # final/, best/, metrics.jsonl untouched
    train(cfg, target=target, overwrite=True)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # no duplicated steps appended


def test_resume_falls_back_to_the_newest_valid_checkpoint(target, rollout_dirs, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(
        run, rollout_dirs, optim={"max_steps": 4}, checkpoint={"save_every": 2, "keep_last": 3}
    )
    train(cfg, target=target)
    assert [s for s, _ in ckpt.step_checkpoints(run)] == [2, 4]
    newest = run / "checkpoints" / "step-4" / "trainer_state.pt"
    with open(newest, "r+b") as fh:
        fh.truncate(200)
    warnings: list[str] = []
    assert ckpt.latest_valid_checkpoint(run, warnings.append) == run / "checkpoints" / "step-2"
    assert "skipping step 4" in warnings[0] and "trainer_state.pt" in warnings[0]
    more = make_config(
        run, rollout_dirs, optim={"max_steps": 6}, checkpoint={"save_every": 2, "keep_last": 3}
    )
    train(more, target=target, resume=True)  # continues from step 2 instead of a traceback
    progress = ckpt.read_progress(run / "checkpoints" / "step-6")
    assert progress.step == 6


def test_leftovers_of_killed_writes_are_removed(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    good = root / "step-4"
    good.mkdir(parents=True)
    for name in (ckpt.STATE_JSON, ckpt.STATE_PT):
        (good / name).write_text("x")
    leftovers = [
        root / "..tmp-step-6-123.tmp-1a2b3c4d",  # models.checkpoint's temp inside ours
        root / ".tmp-step-6-123",
        root / ".prune-step-2",  # a prune killed mid-delete
        root / "step-1",  # a half-deleted step dir from an older version's prune
        run / ".final.tmp-0badc0de",
        run / ".final.old-0badc0de",
    ]
    for d in leftovers:
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (run / "final").mkdir()
    ckpt.recover_interrupted_swaps(run)
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "final"]


def test_a_full_disk_is_named_not_a_torch_traceback(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    path = tmp_path / "checkpoints" / "step-2"
    with pytest.raises(OSError) as info:
        ckpt.write_checkpoint_dir(
            path, lambda p: p.mkdir(parents=True), {}, ckpt.TrainerProgress(), "x: 1\n"
        )
    assert os_error_message(info.value) == f"{path / ckpt.STATE_PT}: the disk is full"
    assert not any((tmp_path / "checkpoints").iterdir())  # no half-written checkpoint left
    ro = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run")
    assert os_error_message(ro) == "/mnt/ro/run: the file system is read-only"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    from blockdraft.targets.registry import load_target

    root = tmp_path_factory.mktemp("local")
    model = save_local_model(root / "model")
    t = load_target(str(model), progress=False)
    return {"model": model, "rollouts": make_rollouts(t, root / "r", n=6, shard_size=3)}


def _train_cli(capsys, local, run_dir, *extra):
    return run_cli(
        capsys,
        "train",
        "--config",
        REPO / "configs" / "tiny.yaml",
        f"target.name={local['model']}",
        f"data.train_rollouts={local['rollouts']}",
        f"data.eval_rollouts={local['rollouts']}",  # with the shipped eval_split: 0.05
        f"run_dir={run_dir}",
        "optim.max_steps=1",
        "num_anchors=4",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        *extra,
    )


def test_train_cli_errors_are_one_line(capsys, local, tmp_path):
    code, _, err = _train_cli(capsys, local, tmp_path / "run", "target.name=/no/such")
    assert code == 2 and "'/no/such': no such directory" in one_line_error(err)
    code, _, err = _train_cli(capsys, local, "/proc/blockdraft-run")
    assert code == 2 and "/proc/blockdraft-run" in one_line_error(err)
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_rollouts: [a,\n  eval_split: 0\n")
    code, _, err = run_cli(capsys, "train", "--config", bad)
    assert code == 2 and f"{bad}:4: not valid YAML" in one_line_error(err)


def test_train_cli_reports_final_mal_on_rank_zero_only(capsys, local, tmp_path, monkeypatch):
    code, out, err = _train_cli(capsys, local, tmp_path / "run")
    assert code == 0, err
    assert "final drafter:" in out and "final held-out MAL" in out
    code, _, err = _train_cli(capsys, local, tmp_path / "run")
    assert code == 2 and "--overwrite" in one_line_error(err)
    monkeypatch.setenv("RANK", "1")  # what torchrun sets on the other processes
    code, out, err = _train_cli(capsys, local, tmp_path / "run", "--overwrite")
    assert code == 0, err
    assert "final drafter" not in out


def test_shipped_config_takes_eval_rollouts_and_null_split():
    from blockdraft.training.config import load_config

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.eval_rollouts=rollouts/held"])
    assert cfg.data.eval_rollouts == "rollouts/held"
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.eval_split=null"])
    assert cfg.data.eval_split is None
