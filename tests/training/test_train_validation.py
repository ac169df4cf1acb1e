"""`blockdraft train` checks every setting before it writes anything, and a resumed run
refuses a config that changes what its checkpoint means (issue 29)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clikit import make_rollouts, one_line_error, run_cli, save_local_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    from blockdraft.targets.registry import load_target

    root = tmp_path_factory.mktemp("local")
    model = save_local_model(root / "model")  # max_position_embeddings 1024, vocab 375
    t = load_target(str(model), progress=False)
    return {"model": model, "rollouts": make_rollouts(t, root / "r", n=6, shard_size=3)}


def _train(capsys, local, run_dir, *extra):
    return run_cli(
        capsys, "train", "--config", REPO / "configs" / "tiny.yaml",
        f"target.name={local['model']}", f"data.train_rollouts={local['rollouts']}",
        "data.eval_split=0", f"run_dir={run_dir}", "num_anchors=4", "data.max_seq_len=128",
        "logging.progress=false", "logging.tensorboard=false", "eval.at_start=false", *extra,
    )  # fmt: skip


def _written(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []


@pytest.mark.parametrize(
    "override,key",
    [
        ("drafter.draft_vocab_size=1000", "drafter.draft_vocab_size"),  # vocab is 375
        ("target.layer_ids=[1,99]", "target.layer_ids"),  # 4 layers
        ("data.max_seq_len=4096", "data.max_seq_len"),  # context is 1024
        ("device=cuda:7", "device"),  # no such GPU here (nor on a one-GPU machine)
    ],
)
def test_target_dependent_settings_are_one_line_naming_the_key(
    override, key, local, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    code, _, err = _train(capsys, local, run_dir, "optim.max_steps=1", override)
    assert code == 2
    assert one_line_error(err).startswith(f"error: {key}:"), err
    assert _written(run_dir) == []  # at most the empty directory


def test_batch_split_is_checked_before_anything_is_written(local, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=1", "optim.batch_size=3", "optim.grad_accum=2"
    )
    assert code == 2 and "optim.batch_size" in one_line_error(err)
    assert "metrics.jsonl" not in _written(run_dir) and "run.yaml" not in _written(run_dir)
    # the corrected rerun is not refused as "already holds a run"
    code, out, err = _train(
        capsys, local, run_dir, "optim.max_steps=1", "optim.batch_size=4", "optim.grad_accum=2"
    )
    assert code == 0, err
    assert "final drafter" in out


def test_resume_refuses_a_config_that_changes_the_checkpoint(local, tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = ("checkpoint.save_every=1", "objective.name=dpace")
    code, _, err = _train(capsys, local, run_dir, "optim.max_steps=2", *common)
    assert code == 0, err
    run_yaml = (run_dir / "run.yaml").read_text()
    metrics = (run_dir / "metrics.jsonl").read_text()

    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=3", *common, "objective.name=uniform", "--resume"
    )
    line = one_line_error(err)
    assert code == 2 and "objective.name 'dpace' -> 'uniform'" in line, line
    assert "--allow-changed objective.name" in line
    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=3", *common, "drafter.num_layers=2", "--resume"
    )  # was a state_dict RuntimeError traceback
    line = one_line_error(err)
    assert code == 2 and "drafter.num_layers 1 -> 2" in line, line
    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=3", *common, "data.train_subset=4", "--resume"
    )  # another training set is another run
    assert code == 2 and "data.train_subset None -> 4" in one_line_error(err)
    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=3", *common, "drafter.num_layers=2",
        "--resume", "--allow-changed", "drafter.num_layers",
    )  # fmt: skip
    assert code == 2 and "cannot change on resume" in one_line_error(err)
    # refused resumes changed nothing
    assert (run_dir / "run.yaml").read_text() == run_yaml
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    # asked for explicitly, the objective may change mid-run; other keys change freely
    code, _, err = _train(
        capsys, local, run_dir, "optim.max_steps=3", *common, "objective.name=uniform",
        "optim.lr=1e-4", "--resume", "--allow-changed", "objective.name",
    )  # fmt: skip
    assert code == 0, err
    assert "name: uniform" in (run_dir / "run.yaml").read_text()


def test_default_max_seq_len_is_lowered_to_a_short_context(local, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out, err = _train(capsys, local, run_dir, "optim.max_steps=1", "data.max_seq_len=2048")
    assert code == 0, err  # the built-in default fits any target: noted, not refused
    assert "data.max_seq_len 2048 (the default) is longer than the context" in out
    assert "max_seq_len: 1024" in (run_dir / "run.yaml").read_text()


def test_a_config_far_beyond_free_memory_is_refused_before_allocating(local, tmp_path, capsys):
    """`drafter.block_size=100000` would be killed for memory mid-step: the memory plan
    (`train --plan`) against what the machine has free refuses it in one line first, and
    the run directory is not left behind."""
    run_dir = tmp_path / "run"
    code, _, err = _train(capsys, local, run_dir, "optim.max_steps=1", "drafter.block_size=100000")
    assert code == 2
    line = one_line_error(err)
    assert line.startswith("error: memory:") and "GiB" in line and "drafter.block_size" in line
    assert not run_dir.exists()
