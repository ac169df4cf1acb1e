"""Rollout sets read by `train` and `eval`: broken, altered, incomplete or foreign sets are
refused with one line naming the file (issue 16: F1, F2, F3, F8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockdraft.data.rollouts.store import RolloutError, RolloutSet
from blockdraft.targets.fingerprint import legacy_target_fingerprint, target_fingerprint
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli, save_local_model, save_random_drafter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    model = save_local_model(root / "model")
    target = load_target(str(model), progress=False)
    rollouts = make_rollouts(target, root / "rollouts", n=6, shard_size=2)
    drafter = save_random_drafter(target, root / "drafter")
    return {"model": model, "target": target, "rollouts": rollouts, "drafter": drafter}


def _copy(setup, tmp_path) -> Path:
    out = tmp_path / "r"
    shutil.copytree(setup["rollouts"], out)
    return out


def _eval(capsys, setup, rollouts, *extra):
    return run_cli(
        capsys,
        "eval",
        "--target",
        setup["model"],
        "--rollouts",
        rollouts,
        setup["drafter"],
        "--no-progress",
        "--n-boot",
        "20",
        "--cache-dir",
        rollouts.parent / "cache",
        *extra,
    )


def _train_setup(setup, rollouts, **data):
    from blockdraft.training.builders import load_train_eval
    from blockdraft.training.config import config_from_dict

    cfg = config_from_dict({"data": {"train_rollouts": str(rollouts), **data}})
    return load_train_eval(cfg, setup["target"])


def test_train_subset_keeps_n_training_rollouts_and_the_same_held_out_set(setup):
    full, ev_full = _train_setup(setup, setup["rollouts"], eval_split=0.34)
    sub, ev_sub = _train_setup(setup, setup["rollouts"], eval_split=0.34, train_subset=2)
    assert len(full.rollouts) == 4 and len(sub.rollouts) == 2
    ids = lambda data: [r.prompt_id for r in data.rollouts]  # noqa: E731
    assert set(ids(sub)) <= set(ids(full)) and ids(ev_sub) == ids(ev_full)
    with pytest.raises(Exception, match="data.train_subset: 5 but .* has 4 training rollouts"):
        _train_setup(setup, setup["rollouts"], eval_split=0.34, train_subset=5)


def _train_cli(capsys, setup, rollouts, tmp_path):
    return run_cli(
        capsys,
        "train",
        "--config",
        REPO / "configs" / "tiny.yaml",
        f"target.name={setup['model']}",
        f"data.train_rollouts={rollouts}",
        f"run_dir={tmp_path / 'run'}",
        "logging.progress=false",
        "logging.tensorboard=false",
    )


def test_truncated_shard_is_one_line_error_in_eval_and_train(setup, tmp_path, capsys):
    r = _copy(setup, tmp_path)
    shard = r / "shard-00001.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    code, _, err = _eval(capsys, setup, r)
    assert code == 2
    line = one_line_error(err)
    assert str(shard) in line and "truncated" in line
    code, _, err = _train_cli(capsys, setup, r, tmp_path)
    assert code == 2
    line = one_line_error(err)
    assert "data.train_rollouts" in line and str(shard) in line
    # the header-only reader (split by prompt id) also names the file, never a traceback
    raw = RolloutSet(r, json.loads((r / "manifest.json").read_text()))
    with pytest.raises(RolloutError, match="shard-00001"):
        raw.prompt_ids  # noqa: B018
    with pytest.raises(RolloutError, match="shard-00001"):
        raw[2]


def test_flipped_byte_is_refused_not_used(setup, tmp_path, capsys):
    r = _copy(setup, tmp_path)
    shard = r / "shard-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # inside the token data: same size, still a valid safetensors file
    shard.write_bytes(bytes(data))
    code, _, err = _eval(capsys, setup, r)
    assert code == 2 and "shard-00002.safetensors: corrupted" in one_line_error(err)
    with pytest.raises(Exception, match="shard-00002.safetensors: corrupted"):
        _train_setup(setup, r)
    # size-only mode is available for huge sets (and does not read the data)
    assert len(RolloutSet.open(r, verify="size")) == 6


def test_incomplete_set_refused_unless_asked(setup, tmp_path, capsys):
    r = _copy(setup, tmp_path)
    manifest = json.loads((r / "manifest.json").read_text())
    manifest["complete"] = False
    manifest["prompts"]["requested"] = 10  # an interrupted `blockdraft rollout`
    (r / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _eval(capsys, setup, r)
    line = one_line_error(err)
    assert code == 2 and "incomplete rollout set (6 of 10" in line and "--allow-incomplete" in line
    with pytest.raises(Exception, match="data.allow_incomplete=true"):
        _train_setup(setup, r)
    code, out, _ = _eval(capsys, setup, r, "--allow-incomplete")
    assert code == 0 and "drafter" in out
    train, _ = _train_setup(setup, r, allow_incomplete=True)
    assert len(train.rollouts) == 6


def test_fingerprint_covers_every_weight(setup, tmp_path, capsys):
    target = setup["target"]
    other_dir = save_local_model(tmp_path / "other")
    other = load_target(str(other_dir), progress=False)
    with torch.no_grad():
        other.model.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    # the old fingerprint (tokenizer, config, 64 embedding rows) could not tell them apart
    assert legacy_target_fingerprint(other) == legacy_target_fingerprint(target)
    assert target_fingerprint(other) != target_fingerprint(target)
    # a bf16 load of the same weights is the same target
    bf16 = load_target(str(setup["model"]), dtype=torch.bfloat16, progress=False)
    assert target_fingerprint(bf16) == target_fingerprint(target)
    # and `eval` refuses the first target's rollouts for the modified copy
    other.model.save_pretrained(other_dir)
    code, _, err = run_cli(
        capsys,
        "eval",
        "--target",
        other_dir,
        "--rollouts",
        setup["rollouts"],
        setup["drafter"],
        "--no-progress",
        "--cache-dir",
        tmp_path / "cache",
    )
    assert code == 2 and "with other weights than target" in one_line_error(err)


def test_legacy_manifest_fingerprint_is_accepted_with_a_warning(setup, tmp_path, capsys):
    r = _copy(setup, tmp_path)
    manifest = json.loads((r / "manifest.json").read_text())
    manifest["target"]["fingerprint"] = legacy_target_fingerprint(setup["target"])
    (r / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _eval(capsys, setup, r)
    assert code == 0 and "old-style target fingerprint" in err


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda m: m["shards"][-1].update(rows=3), "shard-00002.safetensors: holds 2 rollouts"),
        (lambda m: m["shards"][0].update(rows=3), "the shards before it end at row 3"),
        (lambda m: m["shards"][0].update(rows="2"), "'rows'"),
        (lambda m: m["shards"][1].update(first_row=3), "'first_row'"),
        (lambda m: m["shards"].append(dict(m["shards"][0])), "'first_row'"),
        (lambda m: m["settings"].update(temperature="hot"), "settings"),
        (lambda m: m["shards"][0].update(bytes=-1), "'bytes'"),
        (lambda m: m.update(shards={"0": 1}), "'shards'"),
    ],
)
def test_edited_manifest_is_one_line_naming_manifest_and_key(setup, tmp_path, capsys, edit, says):
    """A hand-edited manifest (rows, offsets, types, settings) would index past a shard,
    add a string to an int or read rows twice: refused in one line naming it."""
    r = _copy(setup, tmp_path)
    manifest = json.loads((r / "manifest.json").read_text())
    edit(manifest)
    (r / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = _eval(capsys, setup, r)
    line = one_line_error(err)
    assert code == 2 and str(r) in line and says in line, line
