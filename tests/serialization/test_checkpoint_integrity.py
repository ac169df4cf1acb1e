"""Drafter checkpoints and the serving export: broken files are one-line errors, nothing is
overwritten without `--overwrite`, and the export loads through HF `AutoModel` and computes
the drafter's function (issue 16: F1, F6, export items, weights not 0600)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from blockdraft.errors import CheckpointError
from blockdraft.serialization.checkpoint import load_drafter
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli, save_local_model, save_random_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = save_local_model(root / "model")
    target = load_target(str(model), progress=False)
    rollouts = make_rollouts(target, root / "rollouts", n=4, shard_size=4)
    return {"model": model, "target": target, "rollouts": rollouts, "root": root}


def _drafter(setup, path: Path, **kw) -> Path:
    torch.manual_seed(0)
    return save_random_drafter(setup["target"], path, **kw)


def _eval(capsys, setup, drafter, tmp_path):
    return run_cli(
        capsys,
        "eval",
        "--target",
        setup["model"],
        "--rollouts",
        setup["rollouts"],
        drafter,
        "--no-progress",
        "--n-boot",
        "20",
        "--cache-dir",
        tmp_path / "cache",
    )


def test_truncated_or_corrupt_checkpoint_is_a_one_line_error(setup, tmp_path, capsys):
    ckpt = _drafter(setup, tmp_path / "run" / "final")
    weights = ckpt / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(3026)
    for argv in (
        ("export", ckpt, "--out", tmp_path / "o"),
        ("export", ckpt, "--check"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code != 0 and str(weights) in one_line_error(err)
    code, _, err = _eval(capsys, setup, tmp_path / "run", tmp_path)
    assert code == 2 and f"{weights}: truncated" in one_line_error(err)
    with pytest.raises(CheckpointError, match="truncated"):
        load_drafter(ckpt, setup["target"])

    # one flipped byte, same size: the recorded sha256 catches it
    ckpt2 = _drafter(setup, tmp_path / "c2")
    data = bytearray((ckpt2 / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (ckpt2 / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_drafter(ckpt2, setup["target"])

    # a truncated config.json
    ckpt3 = _drafter(setup, tmp_path / "c3")
    text = (ckpt3 / "config.json").read_text()
    (ckpt3 / "config.json").write_text(text[: len(text) // 2])
    code, _, err = _eval(capsys, setup, ckpt3, tmp_path)
    assert code == 2 and f"{ckpt3 / 'config.json'} is not valid JSON" in one_line_error(err)


def test_init_from_a_broken_checkpoint_names_the_key(setup, tmp_path):
    from blockdraft.training.builders import TrainSetupError, build_drafter, load_train_eval
    from blockdraft.training.config import config_from_dict

    ckpt = _drafter(setup, tmp_path / "init", block_size=8)
    with open(ckpt / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    cfg = config_from_dict(
        {
            "data": {"train_rollouts": str(setup["rollouts"])},
            "drafter": {"init_from": str(ckpt), "block_size": 8},
        }
    )
    train, _ = load_train_eval(cfg, setup["target"])
    with pytest.raises(TrainSetupError, match=r"drafter.init_from: .*model.safetensors: trunc"):
        build_drafter(cfg, setup["target"], train, torch.device("cpu"))


def test_weights_are_not_written_private(setup, tmp_path):
    old = os.umask(0o022)
    try:
        ckpt = _drafter(setup, tmp_path / "c")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((ckpt / "model.safetensors").stat().st_mode)
    assert mode == 0o644, oct(mode)


def test_export_never_replaces_an_existing_directory_unasked(setup, tmp_path, capsys):
    ckpt = _drafter(setup, tmp_path / "c")
    out = tmp_path / "rollouts-by-mistake"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    code, _, err = run_cli(capsys, "export", ckpt, "--out", out)
    assert code != 0 and "--overwrite" in one_line_error(err)
    assert (out / "manifest.json").read_text() == "{}"  # untouched
    # --overwrite replaces only a previous export (issue 29): not this unknown directory
    code, _, err = run_cli(capsys, "export", ckpt, "--out", out, "--overwrite")
    assert code != 0 and "replaces only a previous export" in one_line_error(err)
    assert (out / "manifest.json").read_text() == "{}"
    export = tmp_path / "export"
    assert run_cli(capsys, "export", ckpt, "--out", export)[0] == 0
    code, _, _ = run_cli(capsys, "export", ckpt, "--out", export, "--overwrite")
    assert code == 0 and (export / "model.safetensors").is_file()


def test_export_takes_a_run_dir_checks_its_final_and_prints_serve_commands(setup, tmp_path, capsys):
    run = tmp_path / "runs" / "edr"
    ckpt = _drafter(setup, run / "final")
    torch.save({"step": torch.tensor(1)}, ckpt / "trainer_state.pt")  # as the trainer writes
    (ckpt / "trainer_state.json").write_text("{}")
    code, out, err = run_cli(capsys, "export", ckpt, "--check")
    assert code == 0, err
    code, out, err = run_cli(capsys, "export", run, "--out", tmp_path / "served")
    assert code == 0, err
    assert "--speculative-algorithm DFLASH" in out and "vllm serve" in out
    assert f"--speculative-draft-model-path {tmp_path / 'served'}" in out
    served = tmp_path / "served"
    assert not (served / "trainer_state.pt").exists()
    cfg = json.loads((served / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    tok = setup["target"].tokenizer
    mask = cfg["dflash_config"]["mask_token"]
    assert mask == tok.convert_ids_to_tokens(cfg["dflash_config"]["mask_token_id"])
    assert isinstance(mask, str) and mask


def test_export_to_an_unwritable_place_is_one_line(setup, tmp_path, capsys):
    ckpt = _drafter(setup, tmp_path / "c")
    code, _, err = run_cli(capsys, "export", ckpt, "--out", "/proc/blockdraft-export")
    assert code == 2 and "/proc/blockdraft-export" in one_line_error(err)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_automodel_loads_the_export_and_computes_the_drafter(setup, tmp_path, capsys, dtype):
    from transformers import AutoModel

    target = setup["target"]
    torch.manual_seed(1)
    ckpt = save_random_drafter(target, tmp_path / "c", block_size=5)
    argv = ["export", ckpt, "--out", tmp_path / "served"] + (["--dtype", dtype] if dtype else [])
    assert run_cli(capsys, *argv)[0] == 0
    model = AutoModel.from_pretrained(str(tmp_path / "served"), trust_remote_code=True)
    assert type(model).__name__ == "DFlashDraftModel"
    drafter = load_drafter(tmp_path / "served", target).eval()
    model = model.to(drafter.dtype).eval()

    ids = torch.tensor([target.encode("def add(a, b):\n    return a + b\n")])
    T, a, Kb = ids.shape[1], 6, drafter.config.block_size
    with torch.no_grad():
        features = target.forward(ids, with_logits=False).features
        ours = drafter.forward_blocks(features, ids, torch.tensor([[a]]))[0, 0]  # [K, H]
        block = torch.full((1, Kb), drafter.config.mask_token_id)
        block[0, 0] = ids[0, a]
        hidden = model(
            noise_embedding=drafter.embed(block),
            target_hidden=features[:, :a],
            position_ids=torch.arange(a + Kb)[None],
        )
    assert a + 1 < T and hidden.shape == (1, Kb, drafter.config.hidden_size)
    tol = 1e-5 if dtype is None else 2e-2
    torch.testing.assert_close(hidden[0, 1:].float(), ours.float(), atol=tol, rtol=tol)
    # the weights really were loaded (not freshly initialised)
    assert torch.equal(model.fc.weight, drafter.fc.weight)


def test_export_modeling_file_is_self_contained(setup, tmp_path, capsys):
    ckpt = _drafter(setup, tmp_path / "c")
    assert run_cli(capsys, "export", ckpt, "--out", tmp_path / "s")[0] == 0
    source = (tmp_path / "s" / "modeling_dflash.py").read_text()
    assert "blockdraft" not in source.split('"""')[-1]  # no import of this package
    shutil.rmtree(tmp_path / "s")
