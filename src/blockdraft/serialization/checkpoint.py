"""Drafter checkpoints: `config.json` + `model.safetensors`, in the public DFlash layout.

Why that layout: a checkpoint directory written here *is* a DFlash draft model directory
as z-lab publishes them and SGLang, vLLM and z-lab/dflash read them, so export converts
nothing (weight names and config keys: docs/export.md, "The format"). blockdraft's own
complete `DrafterConfig` lives under the namespaced `"blockdraft"` key the engines
ignore. Loading uses safetensors only and refuses another target's checkpoint naming the
key; saves are atomic (built under a temporary name, then renamed) and record the
weights' size and SHA-256, checked on every load, so damage is a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockdraft.artifacts import check_file, ensure_free_space, file_digest
from blockdraft.drafters.config import ConfigKeyError
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig, check_target_compatible
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.drafters.draft_vocab import draft_ids_from_d2t
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.errors import CheckpointError, disk_write_error
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE
from blockdraft.targets.fingerprint import target_fingerprint

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
NAMESPACE = "blockdraft"
FORMAT_VERSION = 1
SERVING_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# z-lab's DFlash2DraftModel keeps the codebooks in nn.Embedding modules and its
# `from_pretrained` maps the file's names to them; files may carry either spelling
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _architecture(c: DrafterConfig) -> str:
    """The engine-facing class name: a `lookup_inputs` drafter gets one only blockdraft's
    plugin serves, so an engine that would fill its slots with MASK refuses it instead."""
    if c.arch == "dflash2":
        return DFLASH2_ARCHITECTURE
    return LOOKUP_ARCHITECTURE if c.lookup_inputs else SERVING_ARCHITECTURE


def serving_config(config: DrafterConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF-style config.json the DFlash loaders read (without our namespaced key)."""
    c = config
    rope_parameters = {"rope_theta": c.rope_theta, "rope_type": "default", **(c.rope_scaling or {})}
    dflash: dict[str, Any] = {
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
    }
    if c.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = c.input_embedding_scale
    if c.final_logit_softcapping:
        dflash["final_logit_softcapping"] = c.final_logit_softcapping
    if c.output_multiplier != 1.0:
        dflash["output_multiplier"] = c.output_multiplier
    if c.arch == "dflash2":
        dflash.update({key: getattr(c, key) for key in DFLASH2_KEYS})
    layer_types = list(c.layer_types or ["full_attention"] * c.num_hidden_layers)
    sliding = "sliding_attention" in layer_types and c.sliding_window is not None
    out: dict[str, Any] = {
        "architectures": [_architecture(c)],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": False,
        "use_sliding_window": sliding,
        "sliding_window": c.sliding_window if sliding else None,
        "max_window_layers": c.num_hidden_layers,
        "layer_types": layer_types,
        **_causal_key(c),
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "target_hidden_size": c.target_hidden_size,
        "dflash_config": dflash,
        "dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
    }
    if c.draft_vocab_size is not None:
        out["draft_vocab_size"] = c.draft_vocab_size
    return out


def _causal_key(c: DrafterConfig) -> dict[str, Any]:
    """`is_causal` when every layer agrees (what loaders read first); omitted when layers
    differ, so z-lab's per-layer rule (sliding = causal) gives the mix we have."""
    kinds = {c.layer_attention(i)[0] for i in range(c.num_hidden_layers)}
    if c.is_causal is not None or len(kinds) == 1:
        return {"is_causal": bool(c.is_causal if c.is_causal is not None else kinds.pop())}
    return {}


def write_checkpoint_dir(
    path: str | Path,
    config_json: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    check: Callable[[Path], None] | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Atomically (re)place directory `path` with config.json + model.safetensors.

    `extra_files` (name -> bytes) are written alongside; `check(tmp_dir)` may raise to
    abort before anything at `path` is touched.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:  # name the destination, not our temporary sibling
        raise OSError(exc.errno, f"cannot write here ({exc.strerror})", str(path)) from None
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        ensure_free_space(path.parent, sum(t.nbytes for t in tensors.values()), "the weights")
        weights = tmp / WEIGHTS_NAME
        try:
            save_file(tensors, str(weights), metadata={"format": "pt"})
        except OSError:
            raise
        except Exception as exc:  # safetensors reports a full disk as SafetensorError
            raise disk_write_error(path / WEIGHTS_NAME, exc) from None
        os.chmod(weights, _file_mode())
        if NAMESPACE in config_json:
            config_json = dict(config_json)
            config_json[NAMESPACE] = {**config_json[NAMESPACE], "weights": file_digest(weights)}
        (tmp / CONFIG_NAME).write_text(json.dumps(config_json, indent=2, sort_keys=False) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        if check is not None:
            check(tmp)
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.filename is None or str(tmp) in str(exc.filename):  # name what we write
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _file_mode() -> int:
    """0666 minus the process umask: what `open()` would give a new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def verify_weights(path: str | Path, cfg: dict[str, Any] | None = None) -> Path:
    """Check `model.safetensors` of checkpoint `path` is there, whole and unchanged.

    Size and SHA-256 against `blockdraft.weights` when recorded (checkpoints written by
    this version), and always a parse of the safetensors header. Returns the file path;
    raises `CheckpointError` naming the file and what is wrong.
    """
    cfg = read_config(path) if cfg is None else cfg
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in checkpoint directory {path}")
    recorded = (cfg.get(NAMESPACE) or {}).get("weights") if isinstance(cfg, dict) else None
    if recorded:  # the check rollout and feature shards get (artifacts.check_file)
        check_file(file, recorded, CheckpointError, sha256=True, source="config.json")
    try:
        with safe_open(str(file), framework="pt") as f:
            list(f.keys())
    except Exception as exc:  # SafetensorError: header or offsets do not fit the file
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return file


def save_drafter(
    drafter: BlockDrafter, path: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write `drafter` to directory `path` (config.json + model.safetensors), atomically.

    `extra` (JSON-serialisable: objective, step, target id, ...) is stored under
    `config.json["blockdraft"]["extra"]`.
    """
    config_json = serving_config(drafter.config, drafter.dtype)
    config_json[NAMESPACE] = {
        "format_version": FORMAT_VERSION,
        "drafter_config": drafter.config.to_dict(),
        "extra": dict(extra or {}),
    }
    made_for = target_identity(getattr(drafter, "bound_target", None))
    if made_for is not None:
        config_json[NAMESPACE]["target"] = made_for
    json.dumps(config_json)  # fail before touching the disk if extra is not serialisable
    return write_checkpoint_dir(path, config_json, drafter.state_dict())


def target_identity(target: Any) -> dict[str, str] | None:
    """`{"name", "fingerprint"}` of the target a drafter was made for (None if unknown:
    no target bound, or a stand-in without an HF config, as in unit tests)."""
    if target is None:
        return None
    try:
        return {"name": str(target.name), "fingerprint": str(target_fingerprint(target))}
    except Exception:  # a stand-in target: nothing to record
        return None


_WARNED: set[tuple[str, str]] = set()  # (checkpoint, target fingerprint) warned about


def warn_other_target(path: str | Path, cfg: dict[str, Any], target: Any) -> None:
    """One warning line when checkpoint `path` says it was made for another target than
    `target` (its recorded fingerprint differs; without one, its recorded name does).

    A warning, not a refusal: the shapes fit (`check_target_compatible` passed), and
    scoring a drafter on a sibling of its target (another fine-tune, a quantised copy) is
    a legitimate experiment, but one a user must not run without knowing.
    """
    recorded = (cfg.get(NAMESPACE) or {}).get("target")
    now = target_identity(target)
    if now is None:
        return
    if isinstance(recorded, dict) and recorded.get("fingerprint"):
        if recorded["fingerprint"] == now["fingerprint"]:
            return
        what = (
            f"target {recorded.get('name')!r} (fingerprint {str(recorded['fingerprint'])[:12]}) "
            f"but is used with target {now['name']!r} (fingerprint {now['fingerprint'][:12]})"
        )
    else:
        made_for = ((cfg.get(NAMESPACE) or {}).get("drafter_config") or {}).get("target_name")
        if not made_for or _same_name(made_for, now["name"]):
            return
        what = f"target {made_for!r} but is used with target {now['name']!r}"
    key = (str(Path(path).resolve()), now["fingerprint"])
    if key in _WARNED:
        return
    _WARNED.add(key)
    print(
        f"warning: drafter {path} was made for {what}: the shapes fit, so it runs, but its "
        "acceptance is not the one it was trained for",
        file=sys.stderr,
    )


def _same_name(a: str, b: str) -> bool:
    """Two spellings of one target name (a path written relative or absolute)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def checkpoint_hash(path: str | os.PathLike) -> str:
    """sha256 of a checkpoint directory's files (config + weights), streamed."""
    h = hashlib.sha256()
    files = sorted(
        p for p in Path(path).iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")
    )
    if not files:
        raise FileNotFoundError(f"{path}: no config.json / model.safetensors to hash")
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter checkpoint directory: `path` itself, or `path/final` for a run directory."""
    p = Path(path)
    for cand in (p, p / "final"):
        if (cand / CONFIG_NAME).is_file():
            return cand
    what = "no such directory" if not p.exists() else f"no {CONFIG_NAME} in it or in {p / 'final'}"
    raise FileNotFoundError(f"{path}: not a drafter checkpoint ({what})")


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, with a one-line error if missing or malformed."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in checkpoint directory {path}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON (truncated or corrupt?): {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def config_from_serving(cfg: dict[str, Any], target: Any) -> DrafterConfig:
    """A `DrafterConfig` from the serving keys of a public DFlash config.json.

    Lets blockdraft fine-tune or score published drafters (z-lab DFlash and DFlash2) and
    proves that the serving keys we write fully determine our model
    (tests/serialization/test_checkpoint.py). Layers are read as transformers' Qwen3Config
    and z-lab's loader read them: `sliding_window` only counts with `use_sliding_window`,
    missing `layer_types` follow `max_window_layers`, and `is_causal` (else
    `dflash_config.causal`) overrides the per-layer rule (sliding = causal). Variants we
    do not implement (attention sink bias, DFlash2 without a selector) are refused.
    """
    dflash = cfg.get("dflash_config") or {}

    def get(key: str, default: Any = None) -> Any:
        return dflash.get(key, cfg.get(key, default))

    _check_serving_types(cfg, get)

    arch = cfg.get("architectures")
    if arch not in ([SERVING_ARCHITECTURE], [DFLASH2_ARCHITECTURE]):
        raise ValueError(f"architectures {arch} is not a DFlash or DFlash2 drafter")
    dflash2 = arch == [DFLASH2_ARCHITECTURE]
    if get("attention_sink_bias"):
        raise ValueError(f"DFlash variant with attention_sink_bias={get('attention_sink_bias')} "
                         "is not supported")  # fmt: skip
    if not dflash2 and (get("conv_kernel_size") or get("selector_rank")):
        raise ValueError("a DFlashDraftModel config with DFlash2 keys: name it DFlash2DraftModel")
    if dflash2 and not all(get(key) for key in ("conv_kernel_size", "selector_rank",
                                                 "selector_top_k")):  # fmt: skip
        raise ValueError(
            "a DFlash2 config needs conv_kernel_size, selector_rank and selector_top_k"
        )
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= int(cfg.get("max_window_layers", 28))
        else "full_attention"
        for i in range(layers)
    ]  # fmt: skip
    causal = cfg.get("is_causal", dflash.get("causal"))
    if causal is not None and all(bool(causal) == (t == "sliding_attention") for t in layer_types):
        causal = None  # what the per-layer rule gives anyway: one spelling per model
    extra: dict[str, Any] = {}
    if dflash2:
        extra = {key: int(get(key)) for key in DFLASH2_KEYS if get(key) is not None}
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    heads = int(cfg["num_attention_heads"])
    draft_vocab = cfg.get("draft_vocab_size")
    return DrafterConfig(
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]),
        mask_token_id=int(get("mask_token_id", target.mask_token_id)),
        target_layer_ids=list(get("target_layer_ids")),
        num_target_layers=int(get("num_target_layers", target.num_layers)),
        target_hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        target_name=target.name,
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        block_size=int(get("block_size", 16)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        draft_vocab_size=None if draft_vocab in (None, cfg["vocab_size"]) else int(draft_vocab),
        final_logit_softcapping=get("final_logit_softcapping"),
        input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        output_multiplier=float(get("output_multiplier", 1.0)),
        layer_types=None if all(t == "full_attention" for t in layer_types) else list(layer_types),
        sliding_window=None if window is None else int(window),
        is_causal=None if causal is None else bool(causal),
        arch="dflash2" if dflash2 else "dflash",
        **extra,
    )


# serving keys config_from_serving reads, with their type; REQUIRED have no default in
# the engines' loaders either (z-lab's reads `config.block_size` and has none)
_SERVING_INTS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "num_hidden_layers", "block_size", "mask_token_id",
    "num_target_layers", "target_hidden_size", "max_position_embeddings",
    "draft_vocab_size", "sliding_window", *DFLASH2_KEYS,
)  # fmt: skip
_SERVING_FLOATS = (
    "rms_norm_eps", "rope_theta", "final_logit_softcapping", "input_embedding_scale",
    "output_multiplier",
)  # fmt: skip
_SERVING_REQUIRED = (
    "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
    "num_hidden_layers", "block_size", "target_layer_ids",
)  # fmt: skip


def _check_serving_types(cfg: dict[str, Any], get: Callable[[str], Any]) -> None:
    """Refuse a public config whose keys are missing or of the wrong type (`ConfigKeyError`
    naming the key): `int(4.5)` or `float("1e-6")` would quietly make another drafter."""
    for key in _SERVING_REQUIRED:
        if get(key) is None:
            raise ConfigKeyError(f"{key}: missing (the serving engines need it too)")
    for key in _SERVING_INTS + _SERVING_FLOATS:
        value = get(key)
        integer = isinstance(value, int) and not isinstance(value, bool)
        if value is None or integer or (key in _SERVING_FLOATS and isinstance(value, float)):
            continue
        what = "an integer" if key in _SERVING_INTS else "a number"
        raise ConfigKeyError(f"{key}: expected {what}, got {value!r}")
    ids = get("target_layer_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ConfigKeyError(f"target_layer_ids: expected a list of integers, got {ids!r}")


def load_drafter_config(path: str | Path, target: Any = None) -> DrafterConfig:
    """The `DrafterConfig` of a checkpoint: ours, or (given `target`) a public DFlash one.

    Ours is read strictly (`DrafterConfig.from_dict`: no key defaulted, no value
    converted) and must agree with the engine-facing keys of the same file
    (`serving_disagreement`): both are one-line `CheckpointError`s naming the file and
    the key, so a drafter is never scored as one thing and served as another.
    """
    cfg = read_config(path)
    data = cfg.get(NAMESPACE)
    file = Path(path) / CONFIG_NAME
    ours = isinstance(data, dict) and ("drafter_config" in data or "format_version" in data)
    if not ours and target is not None:  # a public drafter (or its export: no own config)
        try:
            return config_from_serving(cfg, target)
        except ConfigKeyError as exc:
            raise CheckpointError(f"{file}: {exc}") from None
    config = own_config(cfg, file)
    problem = serving_disagreement(cfg, config)
    if problem:
        raise CheckpointError(f"{file}: {problem}")
    return config


def own_config(cfg: dict[str, Any], file: str | Path) -> DrafterConfig:
    """blockdraft's `DrafterConfig` stored in config.json `cfg` (read from `file`)."""
    data = cfg.get(NAMESPACE)
    if not isinstance(data, dict) or "drafter_config" not in data:
        raise CheckpointError(
            f"{file} has no '{NAMESPACE}.drafter_config': not a blockdraft checkpoint"
        )
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: checkpoint format_version "
            f"{data.get('format_version')} != supported {FORMAT_VERSION}"
        )
    if not isinstance(data["drafter_config"], dict):
        raise CheckpointError(f"{file}: {NAMESPACE}.drafter_config: expected a mapping")
    try:
        return DrafterConfig.from_dict(data["drafter_config"])
    except ConfigKeyError as exc:
        raise CheckpointError(f"{file}: {NAMESPACE}.drafter_config.{exc}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{file}: bad {NAMESPACE}.drafter_config ({exc})") from None


# engine-facing keys that must say what the drafter's own config says: (where the engines
# read it, DrafterConfig field); `dflash_config.*` is what SGLang / vLLM / z-lab read first
SERVING_CONTRACT = (
    ("dflash_config.block_size", "block_size"),
    ("block_size", "block_size"),
    ("dflash_config.target_layer_ids", "target_layer_ids"),
    ("dflash_config.mask_token_id", "mask_token_id"),
    ("num_hidden_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("num_target_layers", "num_target_layers"),
    ("target_hidden_size", "target_hidden_size"),
)


def serving_disagreement(cfg: dict[str, Any], config: DrafterConfig) -> str | None:
    """The first engine-facing key of config.json `cfg` that says another drafter than
    `config` (blockdraft's own), as one line; None when they agree. A key the file leaves
    out is no disagreement (the engines then read the other spelling)."""
    for spelled, key in SERVING_CONTRACT:
        where, _, name = spelled.rpartition(".")
        holder = cfg.get(where) if where else cfg
        if not isinstance(holder, dict) or name not in holder:
            continue
        value, own = holder[name], getattr(config, key)
        if value != own or type(value) is not type(own):
            return (
                f"{spelled} is {value!r} but {NAMESPACE}.drafter_config.{key} is {own!r}: "
                "engines would run another drafter than blockdraft scores; re-export the "
                "checkpoint (or fix the key by hand)"
            )
    return None


def load_drafter(
    path: str | Path,
    target: Any,
    device: str | torch.device | None = None,
    *,
    adopt_layer_ids: bool = False,
) -> BlockDrafter:
    """Load a drafter saved by `save_drafter` and bind it to `target` (safetensors only).

    Returns a `SemiARDrafter` for `arch == "semi_ar"`, a `DFlash2Drafter` for "dflash2",
    else a `BlockDrafter`, in the dtype
    it was saved in. Public DFlash drafter directories (no `"blockdraft"` key) and our
    exported copies load too. Raises a one-line ValueError if the checkpoint was made for
    another target (hidden size, vocab, layer ids, number of target layers, mask id).

    `adopt_layer_ids=True` (evaluation, decoding, reports): the drafter's config records
    which target layers feed it (`dflash_config.target_layer_ids`, as the serving engines
    read it), so the target is switched to those layers instead of refusing a drafter
    trained with non-default `target.layer_ids`. Callers scoring several drafters load
    each right before using it.
    """
    config = check_made_for(path, target, adopt_layer_ids=adopt_layer_ids)
    weights_file = verify_weights(path)
    try:
        state = load_file(str(weights_file))
    except Exception as exc:  # SafetensorError
        raise CheckpointError(f"{weights_file}: cannot read weights ({exc})") from None
    _drop_target_head_rows(state, target, weights_file)
    for name in CODEBOOKS:  # z-lab's module spelling -> the file's (ours)
        if name + ".weight" in state:
            state[name] = state.pop(name + ".weight")
    cls = {"semi_ar": SemiARDrafter, "dflash2": DFlash2Drafter}.get(config.arch, BlockDrafter)
    drafter = cls(config)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{weights_file} does not match its config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in drafter.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{weights_file}: {name} has shape {tuple(state[name].shape)}, "
                f"expected {tuple(tensor.shape)}"
            )
    drafter.to(state["fc.weight"].dtype)
    drafter.load_state_dict(state, strict=True)
    if device is not None:
        drafter.to(device)
    return drafter.bind_target(target)


def check_made_for(
    path: str | Path, target: Any, *, adopt_layer_ids: bool = False
) -> DrafterConfig:
    """The checkpoint's `DrafterConfig` once it is known to fit `target`: a drafter of
    another target is refused (one line naming the first key that differs) before the
    warning that a sibling target with the same shapes gets (`warn_other_target`).
    `adopt_layer_ids`: see `load_drafter`."""
    config = load_drafter_config(path, target)
    wanted = list(config.target_layer_ids)
    adoptable = config.num_target_layers == target.num_layers and all(
        0 <= i < target.num_layers for i in wanted
    )
    if adopt_layer_ids and wanted != list(target.layer_ids) and adoptable:
        target.layer_ids = wanted
    check_target_compatible(config, target)
    warn_other_target(path, read_config(path), target)
    return config


def _drop_target_head_rows(state: dict[str, torch.Tensor], target: Any, file: Path) -> None:
    """Accept an exported reduced-vocab `lm_head.weight` if it is the target's own rows."""
    head = state.pop("lm_head.weight", None)
    if head is None or "d2t" not in state:
        if head is not None:
            raise ValueError(f"{file} ships an lm_head.weight; the drafter uses the target's head")
        return

    rows = (
        target.lm_head.weight.detach().to("cpu").index_select(0, draft_ids_from_d2t(state["d2t"]))
    )
    if not torch.equal(rows.to(head.dtype), head):
        raise ValueError(f"{file}: lm_head.weight differs from the target's head rows (own head)")
