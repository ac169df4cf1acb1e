"""A Hugging Face causal LM (hub id or local folder) loaded as a `Target`.

Why apart from the registry: loading an arbitrary model is where it fails in many ways
(custom code not trusted, pickle weights refused, not in the local cache, no mask
token), each said here in one line naming the target and what to do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from blockdraft.errors import BlockdraftError
from blockdraft.targets.target import Target, default_layer_ids

# Tokens that tokenizers reserve and models never emit, most specific first.
_RESERVED_PATTERNS = [
    r"<\|mask\|>",
    r"<mask>",
    r"\[MASK\]",
    r"<\|reserved_special_token_\d+\|>",
    r"<unused\d+>",
    r"<\|reserved_\d+\|>",
    r"<reserved_\d+>",
    r"\[unused\d+\]",
]


@contextlib.contextmanager
def transformers_quiet(quiet: bool = True) -> Iterator[None]:
    """transformers' progress bars (`Loading weights`) and info/warning logging off inside
    the block when `quiet` (a `--no-progress` run prints none), restored after it."""
    if not quiet:
        yield
        return
    # lazy: transformers takes seconds to import; callers that load nothing never pay it
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_hf_target(
    name_or_path: str,
    *,
    known: tuple[str, ...] = (),
    device,
    dtype,
    layer_ids,
    num_feature_layers,
    mask_token,
    allow_download: bool,
    trust_remote_code: bool,
) -> Target:
    # lazy: transformers takes seconds to import; the registry is imported by every stage
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name_or_path).expanduser()
    looks_like_path = name_or_path.startswith((".", "/", "~")) or local.exists()
    if looks_like_path and not local.is_dir():
        raise FileNotFoundError(
            f"target {name_or_path!r}: no such directory (known names: {', '.join(known)})"
        )
    online = allow_download and not os.environ.get("HF_HUB_OFFLINE") and not looks_like_path
    source = str(local) if looks_like_path else name_or_path
    kwargs = {"local_files_only": not online, "trust_remote_code": trust_remote_code}
    if looks_like_path and not trust_remote_code:
        _refuse_unknown_model_type(name_or_path, local)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, **_device_map(device), **kwargs
        )
    except ValueError as exc:  # a hub id whose code is its own
        if "trust_remote_code" not in str(exc):
            raise
        raise TargetLoadError(
            f"target {name_or_path!r}: its config asks to run the model's own code, which "
            "runs only with --trust-remote-code (if you trust it)",
            custom_code=True,
        ) from None
    except pickle.UnpicklingError:  # torch's weights-only loader refused a pickle file
        files = sorted(p.name for p in local.glob("*.bin")) if looks_like_path else []
        raise TargetLoadError(
            f"target {name_or_path!r}: {', '.join(files) or 'its pickle weights'}: refused "
            "by torch's weights-only loader (the pickle holds more than tensors); use "
            "safetensors weights from a source you trust"
        ) from None
    except OSError as exc:
        if looks_like_path:
            raise FileNotFoundError(
                f"target {name_or_path!r}: not a loadable HF model directory ({exc})"
            ) from exc
        hint = (
            ""
            if online
            else "; it is not in the local HF cache (pass allow_download=True / --allow-download"
            " with HF_HUB_OFFLINE unset)"
        )
        raise FileNotFoundError(f"target {name_or_path!r}: unknown name or model id{hint}") from exc
    if not _device_map(device):  # else already on its device
        model = model.to(device)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    mask_id = choose_mask_token_id(tokenizer, vocab, mask_token)
    if mask_id is None:
        raise ValueError(
            f"target {name_or_path!r} has no mask token and no reserved token was found: "
            "pass one with --mask-token (an unused token of its vocabulary)"
        )
    if layer_ids is None:
        n = int(getattr(model.config, "text_config", model.config).num_hidden_layers)
        layer_ids = default_layer_ids(n, num_feature_layers)
    return Target(model, tokenizer, name=name_or_path, mask_token_id=mask_id, layer_ids=layer_ids)


class TargetLoadError(BlockdraftError, ValueError):
    """A target folder or id that cannot be loaded as it stands (custom code not trusted,
    a pickle refused); the message names the target and what to do. `custom_code`: it
    would load with the model's own code (trust_remote_code)."""

    def __init__(self, message: str, custom_code: bool = False) -> None:
        super().__init__(message)
        self.custom_code = custom_code


def _refuse_unknown_model_type(name: str, folder: Path) -> None:
    """A local model whose `model_type` transformers does not implement loads only through
    its own code (`auto_map`): refused in one line before transformers is asked, which
    would print a warning and a traceback. A known type with an `auto_map` loads with
    transformers' own class (as transformers does without trust_remote_code)."""
    # lazy: transformers takes seconds to import; the registry is imported by every stage
    from transformers import CONFIG_MAPPING

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: transformers' own error names the folder
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING:
        return
    auto_map = cfg.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        code = ", ".join(sorted({str(v) for v in auto_map.values()}))
        raise TargetLoadError(
            f"target {name!r}: model_type {model_type!r} runs only with the model's own code "
            f"(auto_map: {code}); pass --trust-remote-code if you trust that code",
            custom_code=True,
        )
    raise TargetLoadError(
        f"target {name!r}: {folder / 'config.json'}: model_type {model_type!r} is not one "
        "this transformers implements, and the folder brings no code (auto_map) for it"
    )


def _device_map(device: str | torch.device) -> dict[str, Any]:
    """`device_map` that loads the weights straight onto an accelerator in their dtype:
    loading on the host first costs a full fp32 copy per process (8 x 33 GB for an 8B
    target on one node). Needs accelerate; without it (and on CPU) the model is moved."""
    dev = torch.device(device)
    if dev.type == "cpu" or importlib.util.find_spec("accelerate") is None:
        return {}
    return {"device_map": {"": str(dev)}}


def choose_mask_token_id(
    tokenizer: Any, vocab_size: int, mask_token: str | int | None = None
) -> int | None:
    """The mask id: an explicit `mask_token`, else the tokenizer's mask token, else a reserved
    special token (e.g. `<unused0>`, `<|reserved_special_token_0|>`), else the first embedding
    row beyond the tokenizer (padded vocabularies such as Qwen's); None if there is none."""
    if mask_token is not None:
        return token_id(tokenizer, mask_token, vocab_size)
    if getattr(tokenizer, "mask_token", None):
        return int(tokenizer.convert_tokens_to_ids(tokenizer.mask_token))
    vocab = tokenizer.get_vocab()
    for pattern in _RESERVED_PATTERNS:
        rx = re.compile(pattern)
        hits = sorted((i, t) for t, i in vocab.items() if rx.fullmatch(t) and i < vocab_size)
        if hits:
            return int(hits[0][0])
    if vocab_size > len(tokenizer):
        return len(tokenizer)  # an embedding row no text ever maps to
    return None


def token_id(tokenizer: Any, token: str | int, vocab_size: int) -> int:
    """The id of `token`: a token string of the vocabulary, an int id (as checkpoints record
    it) or the digits of an id that is not itself a token."""
    if isinstance(token, int) and not isinstance(token, bool):
        if 0 <= token < vocab_size:
            return token
        raise ValueError(f"mask token id {token} is outside the target's vocabulary ({vocab_size})")
    vocab = tokenizer.get_vocab()
    if token in vocab:
        return int(vocab[token])
    if token.isdigit() and int(token) < vocab_size:
        return int(token)
    raise ValueError(f"mask token {token!r} is not a single token of the target's vocabulary")
