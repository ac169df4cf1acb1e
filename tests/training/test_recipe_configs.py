"""The GPU recipe configs (configs/dflash-qwen3-*.yaml) load, carry the DFlash / EDR
recipe values, and the planner's estimate in their header is what `--plan` says now."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from blockdraft.training.config import load_config
from blockdraft.training.memory_plan import GiB, plan_memory

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
HEADER = re.compile(
    r"ddp x8: ([\d.]+) GiB \| fsdp x8: ([\d.]+) GiB \| 1 GPU, grad_accum (\d+): ([\d.]+) GiB"
)


def _hf(size: str):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    data = json.loads((FIXTURES / f"qwen3_{size}_config.json").read_text())
    data.pop("architectures", None)
    return Qwen3Config(**data)


@pytest.mark.parametrize("size", ["4b", "8b"])
@pytest.mark.parametrize("stage", ["", "-edr"])
def test_header_estimate_is_the_planners(size, stage):
    path = ROOT / "configs" / f"dflash-qwen3-{size}{stage}.yaml"
    match = HEADER.search(path.read_text())
    assert match, f"{path.name}: no planner estimate in the header"
    ddp, fsdp, accum, one = match.groups()
    cases = [(8, [], ddp), (8, ["distributed.strategy=fsdp"], fsdp)]
    cases.append((1, [f"optim.grad_accum={accum}"], one))
    for world, overrides, written in cases:
        cfg = load_config(path, overrides)
        plan = plan_memory(cfg, world, "cuda", hf_config=_hf(size))
        assert f"{plan.peak / GiB:.1f}" == written, (path.name, world, overrides)
        assert plan.fits(80e9)


@pytest.mark.parametrize("size", ["4b", "8b"])
def test_recipe_values(size):
    cfg = load_config(ROOT / "configs" / f"dflash-qwen3-{size}.yaml")
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.num_anchors) == (5, 16, 512)
    assert (cfg.data.max_seq_len, cfg.optim.lr, cfg.optim.epochs) == (3072, 6e-4, 6)
    assert (cfg.amp, cfg.target.dtype, cfg.device) == ("auto", "auto", "auto")
    edr = load_config(ROOT / "configs" / f"dflash-qwen3-{size}-edr.yaml")
    assert (edr.objective.name, edr.optim.lr, edr.optim.epochs) == ("edr", 3e-5, 1)
    assert (edr.optim.batch_size, edr.objective.max_anchors) == (96, 512)
    assert edr.drafter.init_from == cfg.run_dir + "/final"
