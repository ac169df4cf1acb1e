"""Check a drafter directory against what the DFlash serving loaders read, and export it.

`validate_for_serving(path)` re-derives the weight names and shapes a DFlash (or DFlash2)
loader builds from the *serving* keys of config.json alone (not from blockdraft's own
config) and compares them with the safetensors header, so it is an independent check that
our `state_dict` has the public layout. `export_drafter` validates a copy (optionally cast,
with `modeling_dflash.py` for transformers) before moving it into place. Every rule and
the engine code it comes from: docs/export.md ("What `validate_for_serving` checks").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from blockdraft.artifacts import (
    LOCK_NAME,
    describe_artifact,
    enclosing_artifact,
    file_problem,
    sha256_bytes,
    stored_artifact,
    writer_lock,
)
from blockdraft.drafters.draft_vocab import draft_ids_from_d2t
from blockdraft.drafters.lookup_inputs import lookup_rule
from blockdraft.errors import CheckpointError
from blockdraft.serialization.checkpoint import (
    CODEBOOKS,
    CONFIG_NAME,
    DFLASH2_ARCHITECTURE,
    NAMESPACE,
    SERVING_ARCHITECTURE,
    WEIGHTS_NAME,
    check_made_for,
    own_config,
    read_config,
    resolve_checkpoint,
    serving_disagreement,
    verify_weights,
    write_checkpoint_dir,
)
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE, SECTION, ServingRules
from blockdraft.targets.registry import load_tokenizer

_FLOATS = {torch.float32, torch.bfloat16, torch.float16}
MODELING_FILE = "modeling_dflash.py"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
AUTO_MAP_DFLASH2 = {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
DEFAULT_MASK_TOKEN = "<|MASK|>"  # what SGLang assumes when dflash_config.mask_token is unset
# training-only files a run's checkpoint holds next to the drafter; export does not copy them
TRAINER_FILES = {"trainer_state.pt", "trainer_state.json", "run.yaml"}


class ExportError(CheckpointError):
    """An export that would lose data or produce an unservable directory."""


def dflash_field(cfg: dict[str, Any], key: str) -> Any:
    """A DFlash field from `dflash_config` first, then the top level (as the loaders do)."""
    sub = cfg.get("dflash_config") or {}
    return sub.get(key, cfg.get(key))


def expected_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes a DFlash loader builds from a serving config.json."""
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, d = (
        int(cfg["num_attention_heads"]),
        int(cfg.get("head_dim") or H // int(cfg["num_attention_heads"])),
    )
    kv = int(cfg.get("num_key_value_heads") or heads)
    n_ctx = len(dflash_field(cfg, "target_layer_ids"))
    target_h = int(cfg.get("target_hidden_size") or H)
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, n_ctx * target_h),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (heads * d, H),
                p + "self_attn.k_proj.weight": (kv * d, H),
                p + "self_attn.v_proj.weight": (kv * d, H),
                p + "self_attn.o_proj.weight": (H, heads * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
        if cfg.get("attention_bias"):
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (heads * d,),
                    p + "self_attn.k_proj.bias": (kv * d,),
                    p + "self_attn.v_proj.bias": (kv * d,),
                    p + "self_attn.o_proj.bias": (H,),
                }
            )
    if cfg.get("architectures") == [DFLASH2_ARCHITECTURE]:
        taps, group = (
            int(dflash_field(cfg, "conv_kernel_size")),
            int(dflash_field(cfg, "conv_group_size")),
        )
        rank, vocab = int(dflash_field(cfg, "selector_rank")), int(cfg["vocab_size"])
        for i in range(int(cfg["num_hidden_layers"])):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, H)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (H // group), H)
        shapes["candidate_selector.hidden_projection.weight"] = (rank, H)
        shapes["candidate_selector.predecessor_codebook"] = (vocab, rank)
        shapes["candidate_selector.successor_codebook"] = (vocab, rank)
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(cfg["vocab_size"]):
        shapes["d2t"] = (int(draft_vocab),)
        shapes["lm_head.weight"] = (int(draft_vocab), H)
    return shapes


def _config_problems(cfg: dict[str, Any]) -> list[str]:
    problems = []
    dflash2 = cfg.get("architectures") == [DFLASH2_ARCHITECTURE]
    lookup = cfg.get("architectures") == [LOOKUP_ARCHITECTURE]
    if cfg.get("architectures") != [SERVING_ARCHITECTURE] and not dflash2 and not lookup:
        problems.append(
            f"architectures is {cfg.get('architectures')}, engines need "
            f"[{SERVING_ARCHITECTURE!r}] (or [{DFLASH2_ARCHITECTURE!r}], or "
            f"[{LOOKUP_ARCHITECTURE!r}] with blockdraft's vLLM plugin)"
        )
    if dflash2:
        hidden = cfg.get("hidden_size")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = dflash_field(cfg, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"dflash_config.{key} {value!r} missing or not a positive int")
        draft = cfg.get("draft_vocab_size")
        if draft is not None and draft != cfg.get("vocab_size"):
            problems.append(
                f"draft_vocab_size {draft}: z-lab's DFlash2 format has no reduced draft "
                "vocabulary (its selector codebooks span the target's); export it with "
                "--expand-vocab (z-lab's full-vocabulary layout) or train it on the full one"
            )
        group = dflash_field(cfg, "conv_group_size")
        if isinstance(group, int) and group > 0 and isinstance(hidden, int) and hidden % group:
            problems.append(f"conv_group_size {group} does not divide hidden_size {hidden}")
    if cfg.get("model_type") != "qwen3":
        problems.append(
            f"model_type is {cfg.get('model_type')!r}, the DFlash config class is 'qwen3'"
        )
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "num_target_layers",
    ):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            problems.append(f"config key {key!r} missing or not a number")
    if cfg.get("rope_theta") is None and not isinstance(cfg.get("rope_parameters"), dict):
        problems.append("no rope_theta / rope_parameters")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {cfg.get('hidden_act')!r}; engines only run silu")
    layer_ids, mask_id, block = (
        dflash_field(cfg, "target_layer_ids"),
        dflash_field(cfg, "mask_token_id"),
        dflash_field(cfg, "block_size"),
    )
    n_target = cfg.get("num_target_layers")
    if (
        not isinstance(layer_ids, list)
        or not layer_ids
        or not all(isinstance(i, int) for i in layer_ids)
    ):
        problems.append("dflash_config.target_layer_ids missing or not a non-empty list of ints")
    elif isinstance(n_target, int) and not all(0 <= i < n_target for i in layer_ids):
        problems.append(
            f"target_layer_ids {layer_ids} out of range for num_target_layers {n_target}"
        )
    if not isinstance(mask_id, int) or not 0 <= mask_id < int(cfg.get("vocab_size") or 0):
        problems.append(f"mask_token_id {mask_id!r} missing or outside the vocabulary")
    if not isinstance(block, int) or block < 2:
        problems.append(f"block_size {block!r} missing or < 2")
    layer_types = cfg.get("layer_types")
    if dflash2:  # published DFlash2 drafters are sliding-window (and may be causal)
        return problems
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        problems.append(
            f"layer_types {layer_types}: DFlash drafting needs full (non-sliding) attention"
        )
    if cfg.get("is_causal") or (cfg.get("dflash_config") or {}).get("causal"):
        problems.append("is_causal is true: block attention must be bidirectional")
    return problems


def serving_rules_of(cfg: dict[str, Any], source: str) -> ServingRules | None:
    """The lookups a config.json's drafter needs served (`serialization/serving_rules.py`):
    its `blockdraft.serving` section (None when absent; `CheckpointError` when bad)."""
    return ServingRules.read(cfg.get(NAMESPACE), source)


def _lookup_problems(cfg: dict[str, Any], file: Path) -> list[str]:
    """A lookup-aware drafter must be named `LOOKUP_ARCHITECTURE` and carry its lookups
    (an engine would otherwise serve another drafter than the one scored), and only such
    a drafter may carry them; a `lookup_inputs` drafter's slots must read `lookup_rule(K)`."""
    try:
        serving = serving_rules_of(cfg, str(file))
    except CheckpointError as exc:
        return [str(exc)]
    named = cfg.get("architectures") == [LOOKUP_ARCHITECTURE]
    own = (cfg.get(NAMESPACE) or {}).get("drafter_config") or {}
    reads_lookup = bool(own.get("lookup_inputs")) if isinstance(own, dict) else False
    block = dflash_field(cfg, "block_size")
    problems = []
    if reads_lookup and (serving is None or serving.inputs is None):
        problems.append(
            "a lookup_inputs drafter without blockdraft.serving.lookup_inputs: an engine "
            "would fill its proposal slots with MASK; export it with `blockdraft export`"
        )
    elif serving is not None and serving.inputs is not None and isinstance(block, int):
        if not reads_lookup:
            problems.append("blockdraft.serving.lookup_inputs on a drafter that reads no lookup")
        elif serving.inputs != lookup_rule(block - 1).config:
            problems.append(
                f"blockdraft.serving.lookup_inputs {serving.to_json()['lookup_inputs']} is not "
                f"the rule the drafter was trained with ({lookup_rule(block - 1).config})"
            )
    if serving is not None and not named:
        problems.append(
            f"blockdraft.serving names lookups but architectures is {cfg.get('architectures')}: "
            f"name it [{LOOKUP_ARCHITECTURE!r}] so that engines without blockdraft's plugin "
            "refuse it"
        )
    elif named and serving is None and not problems:
        problems.append(f"architectures [{LOOKUP_ARCHITECTURE!r}] without blockdraft.serving")
    return problems


def _contract_problems(cfg: dict[str, Any], file: Path) -> list[str]:
    """blockdraft's own config (when the file has one) must read strictly and say what the
    engine-facing keys say: else the drafter scored is not the drafter served."""
    data = cfg.get(NAMESPACE)
    if not isinstance(data, dict) or not ("drafter_config" in data or "format_version" in data):
        return []  # a public drafter: the serving keys are all there is
    try:
        problem = serving_disagreement(cfg, own_config(cfg, file))
    except CheckpointError as exc:
        return [str(exc)]
    return [f"{file}: {problem}"] if problem else []


def shipped_modeling_code() -> bytes:
    """The `modeling_dflash.py` this blockdraft copies into every export."""
    return (Path(__file__).parent / MODELING_FILE).read_bytes()


def _code_problems(path: Path, cfg: dict[str, Any]) -> list[str]:
    """The code a `trust_remote_code=True` loader would run from `path` must be the
    `modeling_dflash.py` recorded at export (size and SHA-256 under `blockdraft.files`;
    an export without the record must equal the shipped file), `auto_map` must name its
    classes, and no other Python file may lie beside it."""
    problems = [
        f"{p.name}: code blockdraft did not write (a trust_remote_code loader may import it); "
        "remove it"
        for p in sorted(path.glob("*.py"))
        if p.name != MODELING_FILE
    ]
    auto_map = cfg.get("auto_map")
    if auto_map is not None and auto_map not in (AUTO_MAP, AUTO_MAP_DFLASH2):
        problems.append(
            f"auto_map {auto_map} names other code than {MODELING_FILE}'s classes; re-export"
        )
    code = path / MODELING_FILE
    if auto_map is None and not code.exists():
        return problems  # a checkpoint: no code to run
    record = ((cfg.get(NAMESPACE) or {}).get("files") or {}).get(MODELING_FILE)
    if isinstance(record, dict):
        problem = file_problem(code, record, sha256=True, source=CONFIG_NAME)
    elif not code.is_file():
        problem = f"{code}: missing (auto_map names it)"
    elif code.read_bytes() != shipped_modeling_code():
        problem = f"{code}: differs from the code blockdraft ships and no hash was recorded"
    else:
        problem = None
    if problem:
        problems.append(f"{problem}; a trust_remote_code loader would run it: re-export")
    return problems


def validate_for_serving(path: str | Path) -> list[str]:
    """Problems that would stop SGLang / vLLM / z-lab dflash loading `path` as a DFlash drafter."""
    path = Path(path)
    try:
        cfg = read_config(path)
    except (FileNotFoundError, ValueError) as exc:
        return [str(exc)]
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        return [f"no {WEIGHTS_NAME} in {path}"]
    pickles = sorted(
        p.name
        for p in path.iterdir()
        if p.suffix in {".bin", ".pt", ".pth", ".pkl"} and p.name not in TRAINER_FILES
    )
    problems = (
        [f"pickle weight files present ({pickles}); ship safetensors only"] if pickles else []
    )
    problems += _config_problems(cfg) + _contract_problems(cfg, path / CONFIG_NAME)
    problems += _lookup_problems(cfg, path / CONFIG_NAME)
    problems += _code_problems(path, cfg)
    if problems:
        return problems
    expected = expected_weight_shapes(cfg)
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        for name in sorted(names - set(expected)):
            if name.startswith("markov_head."):
                problems.append(
                    f"{name}: semi-AR Markov head weights; no serving engine implements them"
                )
            elif "embed_tokens" in name or name.startswith("lm_head"):
                problems.append(f"{name}: the target's embedding/LM head must not be shipped")
            else:
                problems.append(f"unexpected weight {name}")
        for name in sorted(set(expected) - names):
            hint = (
                " (engines always apply q/k norm; train with qk_norm=True)"
                if "_norm." in name and "self_attn" in name
                else ""
            )
            hint = hint or (
                " (a reduced draft vocab needs the head rows: export with a target)"
                if name == "lm_head.weight"
                else ""
            )
            problems.append(f"missing weight {name}{hint}")
        for name in sorted(names & set(expected)):
            t = f.get_tensor(name)
            if tuple(t.shape) != expected[name]:
                problems.append(
                    f"{name} has shape {tuple(t.shape)}, loaders expect {expected[name]}"
                )
            elif name != "d2t" and t.dtype not in _FLOATS:
                problems.append(f"{name} has dtype {t.dtype}")
            elif name != "d2t" and not torch.isfinite(t.float()).all():
                problems.append(f"{name} has non-finite values")
    return problems


def export_drafter(
    ckpt: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    target: Any = None,
    overwrite: bool = False,
    expand_vocab: bool = False,
    hybrid_conf: float | None = None,
    trim_conf: float | None = None,
) -> Path:
    """Write a serving-ready copy of checkpoint `ckpt` to `out_dir`; raise if it would not load.

    `ckpt` may be a run directory (its `final/` is used, as `eval` does). `dtype` casts the
    floating weights (engines usually run bfloat16). A reduced draft vocabulary
    additionally needs `target`, whose LM-head rows are written as `lm_head.weight`. The
    copy gets `auto_map` + `modeling_dflash.py` (so `AutoModel.from_pretrained(out_dir,
    trust_remote_code=True)` builds the DFlash drafter) and `dflash_config.mask_token`;
    it is validated before it is moved into place. An existing, non-empty `out_dir` is
    refused unless `overwrite`, and `overwrite` replaces only a previous export: never a
    run, rollout set, feature set or checkpoint, nor anything inside one (`out_dir`'s
    writer lock is held meanwhile, so two exports never interleave). `expand_vocab`: a
    drafter on a reduced draft vocabulary is written over the target's whole vocabulary
    (`expand_dflash_vocab`; DFlash2 in z-lab's layout, `expand_dflash2_vocab`, which its
    format needs: it is refused otherwise; llama.cpp needs it for either).
    A `lookup_inputs` drafter, or any DFlash drafter with `hybrid_conf` (the `hybrid`
    spec's fallback) or `trim_conf` (the `trim` spec's cut), is written lookup-aware
    (`with_lookups`): served by blockdraft's vLLM plugin only.
    """
    ckpt, out_dir = resolve_checkpoint(ckpt), Path(out_dir)
    if out_dir.resolve() == ckpt.resolve():
        raise ExportError(f"--out {out_dir}: is the checkpoint itself; choose another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: exists and is not a directory")
    _refuse_to_replace(out_dir, overwrite)
    with writer_lock(out_dir, "an export"):
        _refuse_to_replace(out_dir, overwrite)  # as seen now that we hold the lock
        return _export_locked(ckpt, out_dir, dtype, target, expand_vocab, hybrid_conf, trim_conf)


DRAFTER_GGUF = "drafter.gguf"  # `export --format gguf`: the drafter as llama.cpp loads it
EXPORT_FILES = {CONFIG_NAME, WEIGHTS_NAME, MODELING_FILE, DRAFTER_GGUF}


def _refuse_to_replace(out_dir: Path, overwrite: bool) -> None:
    """`--out` must be new, empty, or (with `overwrite`) a previous export and nothing more."""
    inside = enclosing_artifact(out_dir)
    if inside is not None and inside[1] != "run":
        raise ExportError(
            f"--out {out_dir}: lies inside {inside[0]}, which is {describe_artifact(inside[1])}; "
            "choose a directory outside it"
        )
    if not out_dir.is_dir():
        return
    present = sorted(p.name for p in out_dir.iterdir() if p.name != LOCK_NAME)
    if not present:
        return
    if not overwrite:
        raise ExportError(
            f"--out {out_dir}: directory exists and is not empty; pass --overwrite to replace "
            "a previous export or choose another directory"
        )
    kind = stored_artifact(out_dir)
    if kind != "export":
        what = describe_artifact(kind) if kind else f"files that are not an export ({present[0]})"
        raise ExportError(
            f"--out {out_dir}: holds {what}; --overwrite replaces only a previous export, "
            "so choose another directory"
        )
    extra = [n for n in present if n not in EXPORT_FILES]
    if extra:
        raise ExportError(
            f"--out {out_dir}: the previous export also holds {extra[0]}, which --overwrite "
            "would delete; move it away or choose another directory"
        )


def _export_locked(
    ckpt: Path,
    out_dir: Path,
    dtype: torch.dtype | None,
    target: Any,
    expand_vocab: bool,
    hybrid_conf: float | None,
    trim_conf: float | None,
) -> Path:
    cfg = export_config(ckpt, hybrid_conf, trim_conf=trim_conf)
    if target is not None:  # as eval, decode and serve-check refuse it
        check_made_for(ckpt, target, adopt_layer_ids=True)
    weights = verify_weights(ckpt, cfg)
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # SafetensorError
        raise CheckpointError(f"{weights}: cannot read weights ({exc})") from None
    dflash2 = cfg.get("architectures") == [DFLASH2_ARCHITECTURE]
    if expand_vocab and cfg.get("draft_vocab_size") is not None:
        (expand_dflash2_vocab if dflash2 else expand_dflash_vocab)(cfg, tensors)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    if "d2t" in tensors and "lm_head.weight" not in tensors and target is not None:
        head = target.lm_head.weight.detach().to("cpu")
        if head.shape[0] != int(cfg["vocab_size"]) or head.shape[1] != int(cfg["hidden_size"]):
            raise ValueError(
                f"target LM head {tuple(head.shape)} does not fit the drafter "
                f"(vocab {cfg['vocab_size']})"
            )
        rows = head.index_select(0, draft_ids_from_d2t(tensors["d2t"]))
        tensors["lm_head.weight"] = rows.to(tensors["fc.weight"].dtype)
    modeling = shipped_modeling_code()
    ours = cfg.setdefault(NAMESPACE, {})  # a public drafter's export gets the records too
    ours["exported_from"] = str(ckpt)
    ours["files"] = {MODELING_FILE: {"bytes": len(modeling), "sha256": sha256_bytes(modeling)}}
    cfg["auto_map"] = dict(AUTO_MAP_DFLASH2 if dflash2 else AUTO_MAP)
    mask = mask_token_string(cfg, target)
    if mask is not None:
        cfg.setdefault("dflash_config", {})["mask_token"] = mask

    def check(staged: Path) -> None:
        problems = validate_for_serving(staged)
        if problems:
            raise ExportError(f"{ckpt} cannot be served: " + "; ".join(problems))

    return write_checkpoint_dir(
        out_dir, cfg, tensors, check=check, extra_files={MODELING_FILE: modeling}
    )


def with_lookups(
    cfg: dict[str, Any], hybrid_conf: float | None, source: str, trim_conf: float | None = None
) -> dict[str, Any]:
    """`cfg` (a drafter's config.json, changed in place) as a lookup-aware export names it:
    `blockdraft.serving` and `LOOKUP_ARCHITECTURE` for a `lookup_inputs` drafter, a
    `hybrid_conf` fallback or a `trim_conf` cut, unchanged for a plain drafter
    (docs/export.md)."""
    own = (cfg.get(NAMESPACE) or {}).get("drafter_config") or {}
    reads_lookup = bool(isinstance(own, dict) and own.get("lookup_inputs"))
    for name, conf in (("hybrid", hybrid_conf), ("trim", trim_conf)):
        if conf is not None and cfg.get("architectures") == [DFLASH2_ARCHITECTURE]:
            raise ExportError(
                f"{source}: {name} needs a parallel (dflash) drafter; DFlash2 drafts slot by slot"
            )
    block = dflash_field(cfg, "block_size")
    if not isinstance(block, int) or block < 2:
        return cfg  # validation names the bad block_size
    try:
        serving = ServingRules.of(block - 1, reads_lookup, hybrid_conf, trim_conf)
    except ValueError as exc:
        raise ExportError(f"{source}: {exc}") from None
    if serving is not None:
        cfg.setdefault(NAMESPACE, {})[SECTION] = serving.to_json()
        cfg["architectures"] = [LOOKUP_ARCHITECTURE]
    return cfg


def export_config(
    ckpt: str | Path,
    hybrid_conf: float | None = None,
    expand_vocab: bool = False,
    trim_conf: float | None = None,
) -> dict[str, Any]:
    """The config.json an export of `ckpt` will have (lookup-aware, over the whole
    vocabulary): what an engine checks before anything is converted or written."""
    cfg = with_lookups(read_config(ckpt), hybrid_conf, str(ckpt), trim_conf)
    return full_vocab_config(cfg) if expand_vocab else cfg


def full_vocab_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (config.json, changed in place) without its reduced draft vocabulary."""
    cfg.pop("draft_vocab_size", None)
    drafter_config = (cfg.get(NAMESPACE) or {}).get("drafter_config")
    if isinstance(drafter_config, dict):
        drafter_config["draft_vocab_size"] = None
    return cfg


def expand_dflash_vocab(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """A DFlash checkpoint on a reduced draft vocabulary, rewritten in place to score the
    target's whole vocabulary: its head *is* the target's LM head, so only `d2t` (and the
    head rows an export carries) go. Why: llama.cpp loads no `d2t`. The drafter never
    learned to push a token outside its vocabulary down, so where one outscores the
    trained rows the proposal changes; score the export to see how often."""
    tensors.pop("d2t")
    tensors.pop("lm_head.weight", None)
    full_vocab_config(cfg)


def expand_dflash2_vocab(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """A DFlash2 checkpoint on a reduced draft vocabulary D, rewritten in place in z-lab's
    layout, whose unary logits come from the target's whole LM head and whose codebooks
    span the target's vocabulary (no `d2t`).

    The predecessor codebook's D rows go to their tokens and its shared row for tokens
    outside D (row D) to every other token, so every predecessor scores as before; the
    successor rows of tokens outside D are 0, so such a token, if the whole head puts it
    among a slot's top-k, is scored by its unary logit alone. Where no such token enters
    the top-k the proposals are the trained drafter's; how often one does is measured by
    scoring the export (docs/export.md, research/gemma.md)."""
    d2t = tensors.pop("d2t")
    tensors.pop("lm_head.weight", None)  # the target's own head serves the unary logits
    ids = draft_ids_from_d2t(d2t)
    vocab = int(cfg["vocab_size"])
    pred_name, succ_name = CODEBOOKS
    pred, succ = tensors[pred_name], tensors[succ_name]
    if pred.shape[0] != ids.numel() + 1 or succ.shape[0] != ids.numel():
        raise ExportError(
            f"DFlash2 codebooks {tuple(pred.shape)} / {tuple(succ.shape)} do not fit a draft "
            f"vocabulary of {ids.numel()} tokens (expected {ids.numel() + 1} / {ids.numel()} rows)"
        )
    full_pred = pred[-1:].expand(vocab, -1).clone()
    full_pred[ids] = pred[:-1]
    full_succ = succ.new_zeros((vocab, succ.shape[1]))
    full_succ[ids] = succ
    tensors[pred_name], tensors[succ_name] = full_pred, full_succ
    full_vocab_config(cfg)


def mask_token_string(cfg: dict[str, Any], target: Any = None) -> str | None:
    """The mask token as text, for `dflash_config.mask_token` (SGLang reads the string).

    From `target`'s tokenizer, else the tokenizer of the target named in the checkpoint
    (loaded from local files only); an id past the tokenizer (a spare embedding row, as
    the public Qwen3 drafters use) gets SGLang's default `<|MASK|>`. None if unknown.
    """
    mask_id = dflash_field(cfg, "mask_token_id")
    if not isinstance(mask_id, int):
        return None
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None:
        name = ((cfg.get(NAMESPACE) or {}).get("drafter_config") or {}).get("target_name")
        if name:
            tokenizer = load_tokenizer(name)
    if tokenizer is None:
        return None
    if mask_id >= len(tokenizer):
        return DEFAULT_MASK_TOKEN
    token = tokenizer.convert_ids_to_tokens(mask_id)
    return token if isinstance(token, str) and token else None


__all__ = [
    "CONFIG_NAME",
    "DRAFTER_GGUF",
    "ExportError",
    "dflash_field",
    "expected_weight_shapes",
    "export_drafter",
    "validate_for_serving",
]
