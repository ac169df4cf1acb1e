"""`target_fingerprint`: the identity of a loaded target, recorded by everything made from it.

Why every weight: rollouts, acceptance caches, features and checkpoints record the target
they were made with and refuse another; a hash of the vocabulary and config alone would
accept a fine-tuned target with the same shape. `legacy_target_fingerprint` recognises
sets written before every weight was hashed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from safetensors import safe_open

from blockdraft.targets.registry import model_directory
from blockdraft.targets.target import Target

_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "name_or_path",
    "quantization_config",
}


def _clean_config(obj: Any) -> Any:
    if isinstance(obj, dict):
        items = sorted((str(k), v) for k, v in obj.items())
        return {
            k: _clean_config(v)
            for k, v in items
            if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")
        }
    if isinstance(obj, (list, tuple)):
        return [_clean_config(v) for v in obj]
    return obj


def _vocab_and_config_hash(target: Target, prefix: bytes = b"") -> Any:
    """sha256 over `prefix`, the tokenizer's vocabulary by id and the cleaned model config."""
    h = hashlib.sha256(prefix)
    vocab = sorted(target.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(
        json.dumps(_clean_config(target.config.to_dict()), sort_keys=True, default=str).encode()
    )
    return h


def target_fingerprint(target: Target) -> str:
    """A stable hash of a target: tokenizer vocab + model config + *every* weight tensor.

    Rollouts, acceptance caches and checkpoints record it to refuse mixing targets, so it
    changes when any weight does. Tensors are rounded to bf16 (fp32 and bf16 loads agree),
    tied ones hashed once; a tensor that equals its file's cast to another dtype is hashed
    from the file, so every load dtype gives one fingerprint (fp16 then bf16 rounding is
    not bf16 rounding). Computed once per loaded target.
    """
    cached = getattr(target, "_fingerprint", None)
    if cached is not None:
        return cached
    h = _vocab_and_config_hash(target, b"blockdraft-target-fingerprint-v2")
    seen: set[int] = set()
    stored = _StoredWeights(target)
    state = target.model.state_dict()
    names_of: dict[int, list[str]] = {}  # tied tensors: the file holds one of their names
    for name, tensor in state.items():
        names_of.setdefault(tensor.data_ptr(), []).append(name)
    with torch.no_grad():
        for name, tensor in sorted(state.items()):
            key = tensor.data_ptr()
            if key in seen and tensor.numel():
                continue
            seen.add(key)
            h.update(f"{name}:{tuple(tensor.shape)}:".encode())
            t = stored.as_stored(names_of[key], tensor.detach()).reshape(-1)
            for chunk in t.split(1 << 24):  # bounded extra memory for large targets
                if chunk.is_floating_point():
                    chunk = chunk.to(torch.bfloat16).view(torch.int16)
                h.update(chunk.cpu().contiguous().numpy())  # buffer protocol: no copy
    target._fingerprint = h.hexdigest()[:32]
    return target._fingerprint


class _StoredWeights:
    """The safetensors files a model was loaded from (its local directory or HF cache
    snapshot), opened only when a tensor's dtype differs from its file's."""

    def __init__(self, target: Target) -> None:
        self.target, self._index = target, None

    def _files(self) -> dict[str, Any]:
        if self._index is None:
            self._index = {}
            directory = model_directory(self.target)
            if directory is not None:
                for file in sorted(directory.glob("*.safetensors")):
                    try:
                        handle = safe_open(str(file), framework="pt")
                    except Exception:  # unreadable: hash what is in memory instead
                        continue
                    for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                        self._index[key] = handle
        return self._index

    def as_stored(self, names: list[str], tensor: torch.Tensor) -> torch.Tensor:
        """The file's tensor (under any of `names`) when `tensor` is exactly it cast to
        another dtype, else `tensor` (same dtype, not in the files, or changed in memory)."""
        if not tensor.is_floating_point():
            return tensor
        files = self._files()
        name = next((n for n in names if n in files), None)
        if name is None:
            return tensor
        handle = files[name]
        slice_ = handle.get_slice(name)
        if tuple(slice_.get_shape()) != tuple(tensor.shape):
            return tensor
        stored = handle.get_tensor(name)
        if stored.dtype == tensor.dtype or not stored.is_floating_point():
            return tensor
        if torch.equal(stored.to(tensor.device, tensor.dtype), tensor):
            return stored
        return tensor


def legacy_target_fingerprint(target: Target) -> str:
    """The fingerprint blockdraft wrote before every weight was hashed (vocab, config and 64
    embedding rows). Only to recognise rollout sets written by older versions."""
    h = _vocab_and_config_hash(target)
    weight = target.embed_tokens.weight
    rows = torch.linspace(0, weight.shape[0] - 1, 64).long().to(weight.device)
    sample = weight.detach()[rows].float().to(torch.bfloat16).view(torch.int16).cpu()
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
