"""A GPU-sized config on a machine without CUDA says so in one line and records the
device `auto` resolved to in run.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from trainkit import make_config

from blockdraft.training.builders import cpu_fallback_note, gpu_sized_settings
from blockdraft.training.config import load_config
from blockdraft.training.trainer import train

CONFIGS = Path(__file__).parents[2] / "configs"
CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["tiny", "tiny-edr-finetune", "gemma-3-270m"])
def test_cpu_configs_are_not_gpu_sized(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert gpu_sized_settings(cfg) == [] and cpu_fallback_note(cfg, CPU) is None


def test_recipe_configs_name_their_gpu_sized_settings():
    cfg = load_config(CONFIGS / "dflash-qwen3-8b.yaml")
    note = cpu_fallback_note(cfg, CPU)
    assert note is not None and "\n" not in note
    for part in ("float32", "data.max_seq_len=3072", "num_anchors=512 x drafter.block_size=16"):
        assert part in note, note
    in_bf16 = load_config(CONFIGS / "dflash-qwen3-8b.yaml", ["amp=bf16"])
    assert "bf16 autocast" in cpu_fallback_note(in_bf16, CPU)
    edr = cpu_fallback_note(load_config(CONFIGS / "dflash-qwen3-8b-edr.yaml"), CPU)
    assert "objective.max_anchors=512" in edr and "optim.batch_size=96" in edr
    # asked for the CPU, or on a GPU: nothing to say
    on_cpu = load_config(CONFIGS / "dflash-qwen3-8b.yaml", ["device=cpu"])
    assert cpu_fallback_note(on_cpu, CPU) is None
    assert cpu_fallback_note(cfg, torch.device("cuda", 0)) is None


def test_training_prints_the_note_once_and_records_the_device(
    target, rollout_dirs, tmp_path, capsys
):
    gpu_sized = make_config(
        tmp_path / "a", rollout_dirs, drafter={"num_layers": 3}, optim={"max_steps": 1}
    )
    train(gpu_sized, target=target)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "no CUDA device" in ln]
    assert len(lines) == 1 and "drafter.num_layers=3" in lines[0], lines
    run = yaml.safe_load((tmp_path / "a" / "run.yaml").read_text())
    assert run["device"] == "auto" and run["provenance"]["device"] == "cpu"
    small = make_config(tmp_path / "b", rollout_dirs, optim={"max_steps": 1})
    train(small, target=target)
    assert "no CUDA device" not in capsys.readouterr().out
