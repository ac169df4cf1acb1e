"""Start a drafter's decoder layers from the target's own layers above its feature layers.

Why: a drafter trained on a CPU budget is compute-starved (docs/results/gemma.md), and the
target's layers above the deepest feature layer already turn such hidden states into
next-token predictions; a random layer has to learn that from the rollouts. Weights are
copied where names and shapes agree (Qwen3/Llama names; Gemma 3's `(1 + w)` norms and its
pre-MLP norm mapped); what cannot map (an MLP activation other than SiLU) is reported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def target_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The HF causal LM's decoder layers (`model.model.layers` for Llama/Qwen3/Gemma 3)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to initialise from")
    return layers


def source_layer_ids(num_target_layers: int, feature_layer_ids: list[int], count: int) -> list[int]:
    """The `count` target layers a drafter starts from: those right above the deepest feature
    layer (its features are what the drafter's context holds), shifted down to fit."""
    first = min(max(feature_layer_ids) + 1, num_target_layers - count)
    if first < 0:
        raise ValueError(f"the target has {num_target_layers} layers, the drafter {count}")
    return list(range(first, first + count))


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The multiplicative weight of a target RMSNorm: Gemma's norms scale by `1 + w`."""
    w = norm.weight.detach().float()
    return w + 1.0 if "Gemma" in type(norm).__name__ else w


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str, copied: list[str]) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: drafter {tuple(dst.shape)} vs target {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
    copied.append(name)


@torch.no_grad()
def init_from_target_layers(drafter: nn.Module, target: Any) -> dict[str, Any]:
    """Copy the target's layers into `drafter.layers` (and their norms into the context and
    final norms; `fc` passes the deepest feature layer through). Returns what was copied
    and what was left at its fresh initialisation, for the run's log."""
    c = drafter.config
    layers = target_decoder_layers(target.model)
    ids = source_layer_ids(len(layers), list(c.target_layer_ids), len(drafter.layers))
    copied: list[str] = []
    skipped: list[str] = []
    act = str(getattr(target.config, "hidden_act", None) or "silu")
    if getattr(target.config, "hidden_activation", None):  # Gemma 3's name for it
        act = str(target.config.hidden_activation)
    for i, (ours, j) in enumerate(zip(drafter.layers, ids, strict=True)):
        theirs = layers[j]
        for name in ATTENTION:
            _copy(getattr(ours.self_attn, name).weight,
                  getattr(theirs.self_attn, name).weight, f"layers.{i}.{name}", copied)  # fmt: skip
        for name in ("q_norm", "k_norm"):
            src = getattr(theirs.self_attn, name, None)
            dst = getattr(ours.self_attn, name)
            if src is not None and isinstance(getattr(dst, "weight", None), nn.Parameter):
                _copy(dst.weight, _norm_weight(src), f"layers.{i}.{name}", copied)
        _copy(ours.input_layernorm.weight, _norm_weight(theirs.input_layernorm),
              f"layers.{i}.input_layernorm", copied)  # fmt: skip
        # the norm in front of the MLP: Gemma 3 calls it pre_feedforward_layernorm (its
        # post_attention_layernorm norms the attention output, which ours has no place for)
        pre_mlp = getattr(theirs, "pre_feedforward_layernorm", theirs.post_attention_layernorm)
        _copy(ours.post_attention_layernorm.weight, _norm_weight(pre_mlp),
              f"layers.{i}.post_attention_layernorm", copied)  # fmt: skip
        if act.startswith("silu") or act == "swish":
            for name in MLP:
                _copy(getattr(ours.mlp, name).weight, getattr(theirs.mlp, name).weight,
                      f"layers.{i}.{name}", copied)  # fmt: skip
        else:
            skipped.append(f"layers.{i}.mlp (target activation {act}, drafter silu)")
    # context: the deepest feature layer, normed as the first copied layer norms its input
    h = c.target_hidden_size
    slot = list(c.target_layer_ids).index(max(c.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, slot * h : (slot + 1) * h].copy_(torch.eye(h))
    copied.append("fc (deepest feature layer)")
    _copy(drafter.hidden_norm.weight, _norm_weight(layers[ids[0]].input_layernorm),
          "hidden_norm", copied)  # fmt: skip
    final = getattr(getattr(target.model, "model", target.model), "norm", None)
    if final is not None:
        _copy(drafter.norm.weight, _norm_weight(final), "norm", copied)
    return {"target_layers": ids, "copied": copied, "skipped": skipped}
