"""blockdraft's vLLM plugin: DFlash drafters for Gemma 3 targets, and sampled DFlash on CPUs.

vLLM's Gemma 3 class lacks the EAGLE-3 interface DFlash reads features through, and its
DFlash class ignores `dflash_config.input_embedding_scale` (a Gemma drafter then reads
inputs sqrt(hidden) too small). The plugin registers, under vLLM's own names, a Gemma 3
class recording the residual stream after each requested layer (docs/methods.md "Target
features") and a DFlash class that applies the scale. For vLLM 0.32's CPU build, whose
sampled speculative requests fail, it supplies the rejection sampler's `expand` kernel in
torch (the C++ stand-in leaves draft tokens' temperature/top-k uninitialised) and guards
the top-k mask against zero rows. Lookup-aware exports (`DFlashLookupDraftModel`, whose
`blockdraft.serving` names the prompt lookups a `lookup_inputs` drafter reads or a
`hybrid` fallback takes) are served by the same DFlash class with a lookup-aware
proposer (`vllm_lookup.py`); vLLM without this plugin refuses them. Loaded through the
`vllm.general_plugins` entry point and by blockdraft's engine process; for a vLLM other
than `SUPPORTED_VLLM` it does nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from blockdraft.engines.vllm_lookup import install as install_lookups
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE

SUPPORTED_VLLM = ("0.32.",)
GEMMA3_ARCH = "Gemma3ForCausalLM"
DFLASH_ARCH = "DFlashDraftModel"
_log = logging.getLogger(__name__)


def plugin_applies(version: str | None) -> bool:
    """Whether the installed vLLM is one whose classes this plugin extends."""
    return version is not None and version.startswith(SUPPORTED_VLLM)


def register() -> None:
    """vLLM's plugin hook: override the Gemma 3 and DFlash classes in its model registry."""
    import vllm  # lazy: vLLM is an optional extra
    from vllm import ModelRegistry  # lazy: (the same)

    if not plugin_applies(vllm.__version__):
        _log.warning(
            "blockdraft's Gemma 3 DFlash plugin targets vLLM 0.32, not %s", vllm.__version__
        )
        return

    ModelRegistry.register_model(GEMMA3_ARCH, f"{__name__}:Gemma3WithAuxForCausalLM")
    ModelRegistry.register_model(DFLASH_ARCH, f"{__name__}:ScaledDFlashForCausalLM")
    # the same drafter; its proposer reads the lookups its config names (vllm_lookup.py)
    ModelRegistry.register_model(LOOKUP_ARCHITECTURE, f"{__name__}:ScaledDFlashForCausalLM")
    install_lookups()
    _guard_empty_top_k()
    _expand_in_torch()


def expand_to_tokens(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,  # noqa: N803 - the kernel's own parameter name
) -> None:
    """`output[t] = input_val[r]` for every token t of request r (`cu_num_tokens` the
    running token counts), with `replace_from` values written as `replace_to`."""
    import torch  # lazy: called only inside vLLM

    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def _expand_in_torch() -> None:
    """Have vLLM's CPU platform register `expand_to_tokens` as its `expand` kernel (it
    reads this attribute when it registers its stand-ins, after plugins load)."""
    try:
        from vllm.utils import cpu_triton_utils  # lazy: vLLM's CPU build only
    except ImportError:
        return
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens


def _guard_empty_top_k() -> None:
    """Make vLLM's CPU top-k mask a no-op on zero rows instead of failing on `k.max()`."""
    from vllm.v1.sample.ops import topk_topp_sampler  # lazy: vLLM is an optional extra

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, "guards_empty_rows", False):
        return

    def apply_top_k_only(logits: Any, k: Any) -> Any:
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    apply_top_k_only.guards_empty_rows = True  # type: ignore[attr-defined]
    topk_topp_sampler.apply_top_k_only = apply_top_k_only


@functools.cache
def _classes() -> dict[str, Any]:
    """The plugin's vLLM classes, built once on first use (vLLM is an optional extra)."""
    # lazy: vLLM's model classes, importable only where the engine is installed
    from vllm.distributed import get_pp_group
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    class Gemma3AuxModel(EagleModelMixin, Gemma3Model):
        """Gemma 3's decoder that also returns the residual stream after chosen layers."""

        def forward(
            self,
            input_ids: Any,
            positions: Any,
            intermediate_tensors: Any = None,
            inputs_embeds: Any = None,
            **kwargs: Any,
        ) -> Any:
            if not self.aux_hidden_state_layers or get_pp_group().world_size > 1:
                return super().forward(
                    input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
                )
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
            aux: list[Any] = []
            self._maybe_add_hidden_state(aux, 0, hidden, residual)
            for idx, layer in enumerate(self.layers):
                hidden, residual = layer(positions, hidden, residual, **kwargs)
                # a Gemma layer returns (update, residual): the stream is their sum
                self._maybe_add_hidden_state(aux, idx + 1, hidden, residual)
            hidden, _ = self.norm(hidden, residual)
            return hidden, aux

    class Gemma3WithAuxForCausalLM(Gemma3ForCausalLM, SupportsEagle3):
        """vLLM's Gemma 3 with the EAGLE-3 interface DFlash reads features through."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            # the decoder as built, with the forward above: same modules, same weights
            self.model.__class__ = Gemma3AuxModel

    class ScaledDFlashForCausalLM(DFlashQwen3ForCausalLM):
        """vLLM's DFlash drafter, with the embedding scale the drafter was trained with."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            dflash = getattr(self.config, "dflash_config", None) or {}
            scale = float(dflash.get("input_embedding_scale") or 1.0)
            if scale != 1.0:
                inner = self.model
                embed = inner.embed_input_ids
                inner.embed_input_ids = lambda input_ids: embed(input_ids) * scale

    classes = {
        "Gemma3WithAuxForCausalLM": Gemma3WithAuxForCausalLM,
        "ScaledDFlashForCausalLM": ScaledDFlashForCausalLM,
    }
    for name, cls in classes.items():  # found by pickle and the registry under this module
        cls.__qualname__, cls.__module__ = name, __name__
    return classes


_CLASS_NAMES = ("Gemma3WithAuxForCausalLM", "ScaledDFlashForCausalLM")


def __getattr__(name: str) -> Any:  # vLLM's registry imports the classes by name
    if name in _CLASS_NAMES:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SUPPORTED_VLLM", "plugin_applies", "register"]
