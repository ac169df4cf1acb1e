"""A drafter records the target it was trained for (name and fingerprint); used with
another target of the same shapes it still runs, with one warning line naming both. A
rollout set made with another tokenizer names both targets and what differs (the same
name only once: then the target itself changed)."""

from __future__ import annotations

import json
import shutil

import pytest

from blockdraft.data.rollouts.store import RolloutError, RolloutSet, check_target
from blockdraft.serialization.checkpoint import load_drafter
from blockdraft.targets.fingerprint import target_fingerprint
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli, save_local_model, save_random_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    a, b = save_local_model(root / "a", seed=0), save_local_model(root / "b", seed=1)
    ta, tb = load_target(str(a), progress=False), load_target(str(b), progress=False)
    return {
        "root": root,
        "a": a,
        "b": b,
        "ta": ta,
        "tb": tb,
        "drafter": save_random_drafter(ta, root / "drafter"),
        "rollouts_b": make_rollouts(tb, root / "rollouts-b", n=2, shard_size=2),
    }


def test_checkpoint_records_its_target(setup):
    cfg = json.loads((setup["drafter"] / "config.json").read_text())
    assert cfg["blockdraft"]["target"] == {
        "name": str(setup["a"]),
        "fingerprint": target_fingerprint(setup["ta"]),
    }


def test_another_target_of_the_same_shapes_is_named_in_one_warning(setup, capsys):
    assert target_fingerprint(setup["ta"]) != target_fingerprint(setup["tb"])
    capsys.readouterr()
    load_drafter(setup["drafter"], setup["ta"])
    assert capsys.readouterr().err == ""
    load_drafter(setup["drafter"], setup["tb"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:"), err
    assert str(setup["a"]) in err[0] and str(setup["b"]) in err[0]
    load_drafter(setup["drafter"], setup["tb"])  # said once per process, not per load
    assert capsys.readouterr().err == ""
    copy = shutil.copytree(setup["drafter"], setup["root"] / "copy")
    code, out, err = run_cli(
        capsys, "eval", "--target", setup["b"], "--rollouts", setup["rollouts_b"],
        copy, "--no-progress", "--cache-dir", setup["root"] / "cache",
    )  # fmt: skip
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warned) == 1 and str(setup["a"]) in warned[0], err


def _with_extra_token(src, dst):
    from transformers import AutoTokenizer

    if dst != src:
        shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.add_special_tokens({"additional_special_tokens": ["<extra_probe>"]})
    tok.save_pretrained(dst)
    return dst


def test_tokenizer_mismatch_names_both_targets_and_what_differs(setup, tmp_path):
    model = save_local_model(tmp_path / "m")
    rollouts = make_rollouts(load_target(str(model), progress=False), tmp_path / "r", n=2)
    other = _with_extra_token(model, tmp_path / "other")
    with pytest.raises(RolloutError) as info:
        check_target(RolloutSet.open(rollouts), load_target(str(other), progress=False))
    msg = str(info.value)
    assert f"'{model}'" in msg and f"'{other}'" in msg and "'<extra_probe>'" in msg
    _with_extra_token(model, model)  # the same target, its tokenizer changed: named once
    with pytest.raises(RolloutError) as info:
        check_target(RolloutSet.open(rollouts), load_target(str(model), progress=False))
    msg = str(info.value)
    assert msg.count(str(model)) == 1 and "'<extra_probe>'" in msg


def test_weights_mismatch_names_the_target_once_when_it_changed(setup, tmp_path):
    d = shutil.copytree(setup["rollouts_b"], tmp_path / "r")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["target"]["fingerprint"] = "0" * 32  # made by this target before it changed
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RolloutError) as info:
        check_target(RolloutSet.open(d), setup["tb"])
    assert str(info.value).count(str(setup["b"])) == 1, str(info.value)
    with pytest.raises(RolloutError) as info:  # another target of the same shapes: both
        check_target(RolloutSet.open(setup["rollouts_b"]), setup["ta"])
    assert str(setup["a"]) in str(info.value) and str(setup["b"]) in str(info.value)


def test_a_drafter_of_another_shape_is_refused_without_the_shapes_fit_warning(setup, capsys):
    tiny = load_target("tiny", progress=False)
    with pytest.raises(ValueError, match="made for another target"):
        load_drafter(setup["drafter"], tiny)
    assert "shapes fit" not in capsys.readouterr().err


def test_export_refuses_a_drafter_of_another_target(setup, capsys, tmp_path):
    """As eval, decode and serve-check do: `--target` names what the export will serve
    with, so a drafter whose shapes do not fit it is one line, exit 2, nothing written."""
    out = tmp_path / "export"
    code, stdout, err = run_cli(
        capsys, "export", setup["drafter"], "--target", "tiny", "--out", out
    )
    assert code == 2, stdout
    assert "another target" in one_line_error(err) and "shapes fit" not in err
    assert "validated" not in stdout and not out.exists()
    code, stdout, err = run_cli(
        capsys, "export", setup["drafter"], "--target", setup["a"], "--out", out
    )
    assert code == 0 and "validated" in stdout, err
