"""A drafter's config.json is read once, strictly: a missing or mistyped key of
blockdraft's own config is one line naming the file and the key (never a default that
silently changes the drafter), and the engine-facing keys (`block_size`,
`dflash_config.*`) must say what the drafter's own config says."""

from __future__ import annotations

import json
import shutil

import pytest

from blockdraft.errors import CheckpointError
from blockdraft.serialization.checkpoint import load_drafter, load_drafter_config
from blockdraft.serialization.export import validate_for_serving
from clikit import make_rollouts, one_line_error, run_cli, save_local_model, save_random_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from blockdraft.targets.registry import load_target

    root = tmp_path_factory.mktemp("contract")
    model = save_local_model(root / "model")
    target = load_target(str(model), progress=False)
    return {
        "model": model,
        "target": target,
        "rollouts": make_rollouts(target, root / "rollouts", n=2, shard_size=2),
        "drafter": save_random_drafter(target, root / "drafter", block_size=4),
    }


def _edited(setup, tmp_path, edit) -> tuple:
    d = tmp_path / "edited"
    shutil.copytree(setup["drafter"], d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d, d / "config.json"


def _append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def _own(cfg: dict) -> dict:
    return cfg["blockdraft"]["drafter_config"]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("block_size", None, "missing"),
        ("block_size", 4.5, "4.5"),
        ("rms_norm_eps", "1e-6", "'1e-6'"),
        ("num_hidden_layers", "two", "'two'"),
        ("target_layer_ids", [1, "2"], "'2'"),
        ("qk_norm", 1, "1"),
    ],
)
def test_missing_or_mistyped_key_names_file_and_key(setup, tmp_path, capsys, key, value, says):
    def edit(cfg):
        if value is None:
            del _own(cfg)[key]
        else:
            _own(cfg)[key] = value

    d, file = _edited(setup, tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{file}: blockdraft\.drafter_config\.{key}: "):
        load_drafter_config(d)
    with pytest.raises(CheckpointError, match=says.replace(".", r"\.")):
        load_drafter(d, setup["target"])
    code, _, err = run_cli(
        capsys, "eval", "--target", setup["model"], "--rollouts", setup["rollouts"], d,
        "--no-progress", "--cache-dir", tmp_path / "cache",
    )  # fmt: skip
    assert code == 2 and f"drafter_config.{key}" in one_line_error(err)
    code, out, err = run_cli(capsys, "export", d, "--check")
    assert code != 0 and "servable" not in out.replace("not servable", "")
    assert f"drafter_config.{key}" in err


def test_a_whole_config_still_loads(setup):
    assert load_drafter_config(setup["drafter"]).block_size == 4
    assert validate_for_serving(setup["drafter"]) == []


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("dflash_config", "block_size", 8),
        ("top", "block_size", 8),
        ("dflash_config", "target_layer_ids", [0, 1]),
        ("dflash_config", "mask_token_id", 5),
    ],
)
def test_engine_keys_that_disagree_with_the_drafter_are_refused(
    setup, tmp_path, capsys, where, key, value
):
    def edit(cfg):
        (cfg["dflash_config"] if where == "dflash_config" else cfg)[key] = value

    d, file = _edited(setup, tmp_path, edit)
    spelled = f"dflash_config.{key}" if where == "dflash_config" else key
    problems = validate_for_serving(d)
    assert any(spelled in p and f"drafter_config.{key}" in p for p in problems), problems
    code, out, err = run_cli(capsys, "export", d, "--check")
    assert code == 1 and spelled in err and "1 problem" in out
    with pytest.raises(CheckpointError, match=rf"{file}: {spelled} is "):
        load_drafter(d, setup["target"])


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda c: c.pop("block_size") + c["dflash_config"].pop("block_size"),
            "block_size: missing",
        ),
        (lambda c: c["dflash_config"].update(block_size=4.5), "block_size: expected an integer"),
        (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps: expected a number, got '1e-6'"),
        (lambda c: c.update(num_hidden_layers="two"), "num_hidden_layers: expected an integer"),
    ],
)
def test_public_config_is_read_strictly_too(setup, tmp_path, edit, says):
    """A public DFlash config.json (no blockdraft key): the engines assume no block size,
    so neither does blockdraft, and a number is never converted from a string."""
    d = tmp_path / "public"
    shutil.copytree(setup["drafter"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["blockdraft"]
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"{d / 'config.json'}: {says}"):
        load_drafter(d, setup["target"])


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (
            lambda d: _append(d / "modeling_dflash.py", b"\nimport os\n"),
            "modeling_dflash.py",
        ),
        (lambda d: (d / "helper.py").write_text("import os\n"), "helper.py"),
        (lambda d: (d / "modeling_dflash.py").unlink(), "modeling_dflash.py"),
    ],
)
def test_export_check_verifies_the_code_trust_remote_code_runs(
    setup, tmp_path, capsys, tamper, says
):
    """`modeling_dflash.py` is run by `AutoModel.from_pretrained(..., trust_remote_code=True)`:
    its hash is recorded at export and `--check` refuses any other code beside it."""
    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", setup["drafter"], "--out", out)
    assert code == 0, err
    code, out_text, _ = run_cli(capsys, "export", out, "--check")
    assert code == 0 and "servable" in out_text
    tamper(out)
    code, out_text, err = run_cli(capsys, "export", out, "--check")
    assert code == 1 and "1 problem" in out_text and says in err, err


def test_export_check_refuses_auto_map_to_other_code(setup, tmp_path, capsys):
    out = tmp_path / "export"
    assert run_cli(capsys, "export", setup["drafter"], "--out", out)[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "evil.Model"}
    (out / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "export", out, "--check")
    assert code == 1 and "auto_map" in err and "evil.Model" in err
