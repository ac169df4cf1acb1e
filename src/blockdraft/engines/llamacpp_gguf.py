"""llama.cpp's side of a drafter: where its tools are, what its DFlash path can load, GGUFs.

Why a module of its own: llama.cpp loads GGUF files, not HF folders, so serving a target
with a drafter there means two conversions by llama.cpp's own `convert_hf_to_gguf.py`
(the drafter's with `--target-model-dir`, which takes the target's tokenizer and shape).
Its DFlash graph (`src/models/dflash.cpp`, `common/speculative.cpp`) reads fewer layouts
than the safetensors export describes, so `llamacpp_problem` says what it cannot load
before anything is converted. The tools are built by `make engine-llamacpp` from the
llama.cpp vendored in PyPI's pinned llama-cpp-python sdist (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from blockdraft.artifacts import write_atomic
from blockdraft.engines.interface import EngineError
from blockdraft.serialization.checkpoint import read_config
from blockdraft.serialization.export import DRAFTER_GGUF, dflash_field
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE
from blockdraft.targets.registry import model_directory
from blockdraft.user_cache import cache_root, stable_hash

LLAMACPP_VERSION = "llama-cpp-python 0.3.36's vendored llama.cpp"
TOOLS_ENV = "BLOCKDRAFT_LLAMACPP"  # the folder `make engine-llamacpp` built (src/, build/)
BUILD_HINT = "build it with `make engine-llamacpp` (or set BLOCKDRAFT_LLAMACPP to its folder)"
# Target architectures whose llama.cpp graph exposes the layer inputs DFlash reads and
# whose converter blockdraft has checked (the `llama` and `qwen3` graphs).
LLAMACPP_DFLASH_TARGETS = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM"})
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def tools_dir() -> Path:
    """The llama.cpp folder: $BLOCKDRAFT_LLAMACPP, else `.llamacpp/` of this checkout."""
    env = os.environ.get(TOOLS_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / ".llamacpp"


def server_binary() -> Path | None:
    """The built `llama-server`, or None."""
    path = tools_dir() / "build" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def converter_script() -> Path | None:
    path = tools_dir() / "src" / "convert_hf_to_gguf.py"
    return path if path.is_file() else None


def require_tools() -> tuple[Path, Path]:
    """(llama-server, convert_hf_to_gguf.py), or one `EngineError` line saying what to do."""
    server, script = server_binary(), converter_script()
    if server is None or script is None:
        missing = "llama-server" if server is None else "convert_hf_to_gguf.py"
        raise EngineError(f"llama.cpp's {missing} is not in {tools_dir()}: {BUILD_HINT}")
    return server, script


def llamacpp_problem(drafter_cfg: dict[str, Any], target_config: Any) -> str | None:
    """Why llama.cpp's `draft-dflash` cannot serve this drafter for this target, or None.

    Each rule is a layout the vendored llama.cpp does not load as blockdraft exports it:
    its DFlash graph sizes `fc` as (number of target layers) x (the *draft's* hidden size),
    reads target features only from graphs that expose layer inputs (we check `llama` and
    `qwen3`; those capture no input past the top layer), and its converter writes no `d2t`
    for a DFlash draft."""
    archs = list(getattr(target_config, "architectures", None) or [])
    arch = archs[0] if archs else type(target_config).__name__
    if arch not in LLAMACPP_DFLASH_TARGETS:
        return (
            f"llama.cpp's draft-dflash is checked here for Llama and Qwen3 targets only, not "
            f"{arch} (its target graph must expose the layer inputs the drafter reads)"
        )
    target_h = int(getattr(target_config, "hidden_size", 0) or 0)
    draft_h = int(drafter_cfg.get("hidden_size") or 0)
    if int(drafter_cfg.get("target_hidden_size") or draft_h) != draft_h or draft_h != target_h:
        return (
            f"llama.cpp's DFlash graph needs the drafter's hidden size ({draft_h}) to equal "
            f"the target's ({target_h}): it sizes the feature projection by the draft's width"
        )
    if drafter_cfg.get("architectures") == [LOOKUP_ARCHITECTURE]:
        return (
            "a lookup-aware drafter (lookup inputs, a hybrid fallback or a trim) is served by "
            "blockdraft's vLLM plugin only: llama.cpp's draft-dflash feeds it no lookup tokens "
            "and drafts whole blocks"
        )
    draft_vocab = drafter_cfg.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(drafter_cfg.get("vocab_size") or 0):
        return (
            f"llama.cpp's converter writes no d2t for a DFlash draft, so a reduced draft "
            f"vocabulary ({draft_vocab} tokens) cannot be served by llama.cpp: export it "
            f"with --expand-vocab (the whole vocabulary; score the export to see what changed)"
        )
    if any("DFlash2" in a for a in drafter_cfg.get("architectures") or []):
        return (
            "DFlash2 drafters are not checked with llama.cpp here (its DFlash2 path reads the "
            "selector as a lattice over top-k candidates); serve a plain DFlash drafter"
        )
    layers = int(getattr(target_config, "num_hidden_layers", 0) or 0)
    top = [i for i in dflash_field(drafter_cfg, "target_layer_ids") or [] if int(i) >= layers - 1]
    if layers and top:
        return (
            f"the drafter reads target layer {top[0]}, the top one: llama.cpp's llama/qwen3 "
            f"graphs capture layer inputs only, and no layer follows layer {layers - 1}"
        )
    if dflash_field(drafter_cfg, "mask_token_id") is None:
        return "the drafter names no mask_token_id, which llama.cpp's draft-dflash requires"
    return None


def _byte_level_gpt2(model_dir: Path) -> bool:
    """Whether the folder's tokenizer splits text exactly as GPT-2 does (a ByteLevel
    pre-tokenizer with its regex, no normalizer): llama.cpp's `gpt-2` pre-tokenizer."""
    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    return (
        tok.get("normalizer") is None
        and (tok.get("model") or {}).get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


# Runs llama.cpp's converter in a child. Its pre-tokenizer table knows released tokenizers
# by the hash of their output on a test text; a tokenizer it does not know that splits
# exactly as GPT-2 (checked from tokenizer.json by the parent) is given `gpt-2`.
_RUNNER = """
import runpy, sys
script, gpt2 = sys.argv[1], sys.argv[2] == "1"
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
sys.argv = [script, *sys.argv[3:]]
from conversion import base
original = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if gpt2:
            return "gpt-2"
        raise
base.TextModel.get_vocab_base_pre = pre
runpy.run_path(script, run_name="__main__")
"""


def convert_to_gguf(
    model_dir: str | Path,
    out: str | Path,
    outtype: str = "f32",
    target_dir: str | Path | None = None,
    log: Any = None,
) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` (with
    `--target-model-dir` for a drafter); the file is written beside `out` and moved in."""
    script = converter_script()
    if script is None:
        raise EngineError(
            f"llama.cpp's convert_hf_to_gguf.py is not in {tools_dir()}: {BUILD_HINT}"
        )
    model_dir, out = Path(model_dir), Path(out)
    tokenizer_dir = Path(target_dir) if target_dir is not None else model_dir
    gpt2 = "1" if _byte_level_gpt2(tokenizer_dir) else "0"
    partial = out.with_name(out.name + ".partial")
    args = [sys.executable, "-c", _RUNNER, str(script), gpt2, str(model_dir)]
    args += ["--outtype", outtype, "--outfile", str(partial)]
    if target_dir is not None:
        args += ["--target-model-dir", str(target_dir)]
    if log:
        log(f"[llamacpp] converting {model_dir} to {out.name} ({outtype})")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not partial.is_file():
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise EngineError(
            f"{model_dir}: llama.cpp's converter failed: {lines[-1] if lines else done.returncode}"
        )
    os.replace(partial, out)
    return out


def cached_target_gguf(model_dir: str | Path, outtype: str = "f32", log: Any = None) -> Path:
    """The target folder as a GGUF, converted once per (folder contents, outtype) into the
    user cache (`llamacpp/`): a converted target is reused by every later run."""
    model_dir = Path(model_dir)
    if model_dir.is_file() and model_dir.suffix == ".gguf":
        return model_dir
    stamp = [outtype, str(model_dir.resolve())]
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            st = path.stat()
            stamp.append(f"{path.name}:{st.st_size}:{int(st.st_mtime)}")
    out = cache_root() / "llamacpp" / f"{stable_hash(stamp)}-{outtype}.gguf"
    if out.is_file():
        return out
    convert_to_gguf(model_dir, out, outtype, log=log)
    write_atomic(out.with_suffix(".source.txt"), "\n".join(stamp).encode())
    return out


class GgufFormat:
    """`export --format gguf`: the drafter as `drafter.gguf` in the export folder and the
    target as a GGUF (converted once, in the user cache), for `llama-server -md`."""

    name = "gguf"

    def check(self, drafter_cfg: dict[str, Any], target: Any) -> Path:
        """The target folder the converter reads, once llama.cpp is known to serve the
        pair: the one-line reason it cannot otherwise, before an export is written."""
        if target is None:
            raise EngineError("--format gguf needs --target (the converter reads its folder)")
        problem = llamacpp_problem(drafter_cfg, target.model.config)
        if problem:
            raise EngineError(problem)
        if converter_script() is None:
            raise EngineError(f"llama.cpp is not built in {tools_dir()}: {BUILD_HINT}")
        folder = model_directory(target)
        if folder is None:
            raise EngineError(f"target {target.name!r} has no local model folder to convert")
        return Path(folder)

    def write(
        self, export_dir: str | Path, checked: Path, dtype: str = "float32", log: Any = None
    ) -> str:
        """The `llama-server` command serving both GGUFs, shell-quoted."""
        export_dir, outtype = Path(export_dir), OUTTYPES[dtype]
        target = cached_target_gguf(checked, outtype, log=log)
        drafter = convert_to_gguf(export_dir, export_dir / DRAFTER_GGUF, outtype, checked, log=log)
        k = int(dflash_field(read_config(export_dir), "block_size") or 16) - 1
        return serve_command(target, drafter, k, "f32" if outtype == "f32" else "f16")


GGUF = GgufFormat()


def server_args(
    target_gguf: str | Path,
    *,
    drafter_gguf: str | Path | None = None,
    num_proposals: int = 0,
    ngram_type: str | None = None,
    ngram_size: int = 3,
    cache_type: str = "f32",
) -> list[str]:
    """llama-server's arguments past the binary for a target (and drafter or n-gram type).

    The drafter's KV cache takes the target's precision (`-ctkd/-ctvd`; llama.cpp's default
    f16 would round the injected target features) and drafts are never cut short
    (`--spec-draft-p-min 0`, `--spec-draft-n-min 0`): the evaluator's full-block rounds."""
    args = ["-m", str(target_gguf), "-ctk", cache_type, "-ctv", cache_type]
    if drafter_gguf is not None:
        args += ["-md", str(drafter_gguf), "--spec-type", "draft-dflash"]
        args += ["--spec-draft-n-max", str(num_proposals), "--spec-draft-n-min", "0"]
        args += ["--spec-draft-p-min", "0", "-ctkd", cache_type, "-ctvd", cache_type]
    elif ngram_type is not None:
        args += ["--spec-type", ngram_type, "--spec-draft-n-max", str(num_proposals)]
        if ngram_type == "ngram-simple":
            args += ["--spec-ngram-simple-size-n", str(ngram_size)]
    return args


def serve_command(
    target_gguf: str | Path, drafter_gguf: str | Path, num_proposals: int, cache_type: str = "f32"
) -> str:
    """The shell command serving a target GGUF with a drafter GGUF (absolute, quoted)."""
    args = server_args(
        Path(target_gguf).resolve(),
        drafter_gguf=Path(drafter_gguf).resolve(),
        num_proposals=num_proposals,
        cache_type=cache_type,
    )
    return "llama-server " + " ".join(shlex.quote(a) for a in args)


__all__ = [
    "GGUF",
    "serve_command",
    "server_args",
    "OUTTYPES",
    "cached_target_gguf",
    "convert_to_gguf",
    "llamacpp_problem",
    "require_tools",
    "server_binary",
]
