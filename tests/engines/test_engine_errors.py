"""What a user meets without the engine, or with a target it cannot serve: one line each.

These run with or without vLLM installed (the support table is the fallback when it is
absent; with it installed, its own registry must give the same answers)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, Qwen3Config

from blockdraft.cli import main
from blockdraft.engines import dflash_support, vllm_engine
from blockdraft.engines.dflash_support import VLLM_DFLASH_TARGETS, vllm_dflash_problem


def test_missing_vllm_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: None)
    with pytest.raises(vllm_engine.EngineError, match="make engine"):
        vllm_engine.load_vllm()


def test_gemma2_target_is_refused_and_qwen3_and_gemma3_served():
    """Gemma 2's vLLM class exposes no features; Gemma 3's does through blockdraft's plugin."""
    gemma2 = Gemma2Config(architectures=["Gemma2ForCausalLM"])
    gemma3 = Gemma3TextConfig(architectures=["Gemma3ForCausalLM"])
    qwen = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    problem = vllm_dflash_problem({"architectures": ["DFlashDraftModel"]}, gemma2)
    assert problem is not None and "Gemma2ForCausalLM" in problem
    assert vllm_dflash_problem({"architectures": ["DFlashDraftModel"]}, qwen) is None
    assert vllm_dflash_problem({"architectures": ["DFlashDraftModel"]}, gemma3) is None
    assert "Gemma2ForCausalLM" not in VLLM_DFLASH_TARGETS


def test_dflash2_is_said_to_need_a_gpu_on_a_cpu_machine():
    qwen = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    problem = vllm_dflash_problem({"architectures": ["DFlash2DraftModel"]}, qwen)
    if torch.cuda.is_available():
        assert problem is None
    else:
        assert problem is not None and "GPU" in problem


def test_lookup_aware_drafters_need_the_plugins_vllm(monkeypatch):
    """Only blockdraft's plugin serves `DFlashLookupDraftModel`, and only on vLLM 0.32."""
    qwen = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    lookup = {"architectures": ["DFlashLookupDraftModel"]}
    monkeypatch.setattr(dflash_support, "_installed_vllm_serves", lambda arch: True)
    monkeypatch.setattr(dflash_support, "vllm_version", lambda: "0.32.0")
    assert vllm_dflash_problem(lookup, qwen) is None
    monkeypatch.setattr(dflash_support, "vllm_version", lambda: "0.33.1")
    problem = vllm_dflash_problem(lookup, qwen)
    assert problem is not None and "plugin" in problem and "0.33.1" in problem
    assert vllm_dflash_problem({"architectures": ["DFlashDraftModel"]}, qwen) is None


def test_rollout_with_an_unknown_engine_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["rollout", "--target", "tiny", "--prompts", "stdlib:eval", "--out", "x",
              "--engine", "sglang"])  # fmt: skip
    assert stop.value.code == 2
    assert "--engine" in capsys.readouterr().err


def test_serve_check_needs_rollouts_or_a_suite(capsys):
    assert main(["serve-check", "--target", "tiny", "some-drafter"]) == 2
    assert "--rollouts" in capsys.readouterr().err
