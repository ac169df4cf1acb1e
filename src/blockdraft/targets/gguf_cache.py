"""A GGUF target converted once into a cached safetensors directory, and loaded from it.

Why: transformers dequantises a GGUF on every load, slowly. The first load checks the
file's sha256, converts it once (atomically: an interrupted conversion leaves no entry)
and caches a directory of plain fp32 safetensors that later loads, and vLLM, read.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.targets.target import Target
from blockdraft.user_cache import atomic_directory, write_json

MANIFEST = "blockdraft_manifest.json"


@dataclass(frozen=True)
class GgufTarget:
    """What a named GGUF target is called, which tokens it uses and what it records."""

    name: str
    mask_token: str
    stop_tokens: list[str]
    install_hint: str
    license: str
    chat_template: str | None = None  # for a GGUF that ships none
    note: str = ""  # appended to the conversion's progress line


def sha256_of(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def check_sha256(path: Path, sha: str, expected: str, install_hint: str) -> None:
    if sha != expected:
        raise ValueError(
            f"{path}: sha256 {sha} != expected {expected}; reinstall it ({install_hint})"
        )


def convert_once(
    final: Path, spec: GgufTarget, place_gguf: Callable[[Path], tuple[Path, str]], progress: bool
) -> Path:
    """Convert the GGUF that `place_gguf(tmp)` verifies and returns (path, sha256) into
    `final`; a GGUF it placed inside `tmp` is removed once read. Return `final`."""
    if (final / MANIFEST).is_file():
        return final
    if final.exists():  # not produced by us (no manifest): never trust it
        shutil.rmtree(final)
    # lazy: transformers takes seconds to import; only the conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    with atomic_directory(final) as tmp:
        gguf, sha = place_gguf(tmp)
        if progress:
            print(f"[blockdraft] converting GGUF to safetensors (once{spec.note}) ...", flush=True)
        else:
            hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        finally:
            if not progress:
                hf_logging.enable_progress_bar()
        if gguf.parent == tmp:
            gguf.unlink()
        # The weights are already dequantised fp32; drop the GGUF "quantizer" so they save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = spec.name
        if not tokenizer.chat_template and spec.chat_template:
            tokenizer.chat_template = spec.chat_template
        stop = [tokenizer.convert_tokens_to_ids(t) for t in spec.stop_tokens]
        model.generation_config.eos_token_id = stop
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(
            tmp / MANIFEST,
            {
                "name": spec.name,
                "gguf": gguf.name,
                "gguf_sha256": sha,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer),
                "mask_token": spec.mask_token,
                "stop_tokens": spec.stop_tokens,
                "chat_template": bool(tokenizer.chat_template),
                "conversion_seconds": round(time.perf_counter() - t0, 1),
                "license": spec.license,
            },
        )
    return final


def load_converted(
    path: Path, spec: GgufTarget, layer_ids: list[int] | None, device, dtype: torch.dtype
) -> Target:
    """The converted directory as a `Target`; its mask and stop tokens must be in the
    tokenizer (a one-line error naming the missing ones)."""
    # lazy: transformers takes seconds to import; only loading the model needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = tokenizer.get_vocab()
    missing = [t for t in (spec.mask_token, *spec.stop_tokens) if t not in vocab]
    if missing:
        raise ValueError(f"{spec.name}: tokens {missing} missing from the tokenizer at {path}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return Target(
        model,
        tokenizer,
        name=spec.name,
        mask_token_id=vocab[spec.mask_token],
        layer_ids=layer_ids,
        stop_token_ids=[vocab[t] for t in spec.stop_tokens],
    )
