"""One typed training config: dataclasses, a YAML file, and dotted command-line overrides.

Why typed dataclasses and strict checking: a training run is expensive, so a typo such as
`optim.learning_rate=1e-4` must fail at start-up with the key named, not be silently
ignored while the run uses the default. Every key a YAML file or an override may set is a
field below; anything else is a `ConfigError` that names the offending dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from blockdraft.errors import BlockdraftError
from blockdraft.objectives.losses import Objective
from blockdraft.objectives.params import ObjectiveParamError, ObjectiveParams
from blockdraft.objectives.registry import (
    DEFAULT_OBJECTIVE,
    make_objective,
    objective_class,
    parameter_defaults,
    resolve_alias,
)


class ConfigError(BlockdraftError, ValueError):
    """A config problem, always phrased as one line naming the dotted key at fault."""


@dataclass
class TargetConfig:
    name: str = "tiny"  # registry name (tiny, gemma-3-270m), HF id or local path
    layer_ids: list[int] | None = None  # target layers feeding the drafter; null = DFlash default
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # target weights dtype
    # mask token of a target without one; null = the one the rollouts were made with
    mask_token: str | None = None


@dataclass
class DataConfig:
    train_rollouts: str = ""  # directory written by `blockdraft rollout` (training set)
    eval_rollouts: str | None = None  # held-out rollouts for offline MAL (overrides eval_split)
    eval_split: float | None = 0.0  # without eval_rollouts: hold out this fraction of train prompts
    train_subset: int | None = None  # train on N of the (non-held-out) rollouts; nested in N
    allow_incomplete: bool = False  # use rollout sets whose `blockdraft rollout` was interrupted
    max_seq_len: int = 2048  # prompt+response longer than this are truncated (from the right)
    features: str | None = None  # `blockdraft features` dir: skip the target forward; null = online


@dataclass
class DrafterConfigSection:
    # parallel (DFlash), semi-AR (Markov head) or DFlash2 (convolutions + candidate selector)
    arch: Literal["dflash", "semi_ar", "dflash2"] = "dflash"
    num_layers: int = 1  # drafter decoder layers
    block_size: int = 16  # anchor + K proposals (K = block_size - 1)
    markov_rank: int = 32  # rank of the semi-AR Markov head (semi_ar only)
    lookup_inputs: bool = False  # proposal slots read prompt lookup's tokens (dflash only)
    selector_rank: int = 256  # dflash2: rank of the candidate selector's bilinear term
    selector_top_k: int = 16  # dflash2: candidates re-ranked per slot
    conv_kernel_size: int = 2  # dflash2: taps of the block-local convolutions
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic coefficient
    draft_vocab_size: int | None = None  # reduced draft vocabulary; null = full target vocab
    init_from: str | None = None  # drafter checkpoint to start from (fine-tuning stage)
    init_layers_from_target: bool = False  # start the layers as copies of the target's top ones


@dataclass
class ObjectiveConfig:
    """The objective (any registered name), the rollouts' mode, and the objective's own
    parameters (its `Params`), written flat in the YAML section: `{name, mode, **params}`.
    `cfg.objective.alpha` reads a parameter."""

    name: str = DEFAULT_OBJECTIVE
    mode: Literal["auto", "greedy", "sampling"] = "auto"  # must match the rollouts; auto = read
    params: ObjectiveParams = field(
        default_factory=lambda: objective_class(DEFAULT_OBJECTIVE).Params()
    )

    def __getattr__(self, key: str) -> Any:
        if key == "params" or key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.params, key)

    @property
    def kind(self) -> type[Objective]:
        return objective_class(self.name)

    def build(self, mode: str = "sampling") -> Objective:
        """The objective for rollouts of `mode` ("greedy" | "sampling")."""
        return make_objective(self.name, mode, **dataclasses.asdict(self.params))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, **dataclasses.asdict(self.params)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str) -> ObjectiveConfig:
        """The section's own keys checked by the objective's `Params`; another objective's
        key is accepted at its default only (every older run.yaml holds them all)."""
        data = resolve_alias(data)
        name = data.get("name", DEFAULT_OBJECTIVE)
        hint = typing.get_type_hints(cls)["mode"]
        mode = _coerce(data.get("mode", "auto"), hint, f"{prefix}.mode")
        try:
            params_cls = objective_class(name).Params
            hints, others = typing.get_type_hints(params_cls), parameter_defaults()
            own = {}
            for k, v in data.items():
                key = f"{prefix}.{k}"
                if k in hints:
                    own[k] = _coerce(v, hints[k], key)
                elif k not in ("name", "mode") and others.get(k, v) != v:
                    raise ConfigError(f"{key}: not a parameter of objective {name!r}")
                elif k not in ("name", "mode") and k not in others:
                    valid = ", ".join(["name", "mode", *hints])
                    raise ConfigError(f"unknown config key {key!r} (valid here: {valid})")
            return cls(name, mode, params_cls(**own))
        except ObjectiveParamError as exc:
            raise ConfigError(f"{prefix}.{exc.key}: {exc}") from None


@dataclass
class OptimConfig:
    lr: float = 6e-4  # peak AdamW learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # fraction of total steps with linear warm-up
    warmup_steps: int | None = None  # overrides warmup_ratio when set
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0  # final lr as a fraction of lr (cosine/linear)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    grad_accum: int = 1  # micro-batches per optimizer step (per process)
    batch_size: int = 8  # GLOBAL sequences per optimizer step (all processes, all micro-batches)
    epochs: float = 1.0  # passes over the training rollouts (ignored when max_steps is set)
    max_steps: int | None = None  # optimizer steps; overrides epochs


@dataclass
class EvalConfig:
    every: int = 200  # evaluate offline MAL on data.eval_rollouts every N steps (0 = only at end)
    max_rollouts: int = 64  # held-out rollouts used per evaluation
    at_start: bool = True  # also evaluate before the first step (the "before" number)


@dataclass
class CheckpointConfig:
    save_every: int = 500  # steps between checkpoints (0 = only final)
    keep_last: int = 3  # step-N checkpoints kept (best/ and final/ are extra)


@dataclass
class LoggingConfig:
    every: int = 10  # steps between log events (metrics.jsonl, tensorboard)
    tensorboard: bool = True
    wandb: bool = False  # needs `pip install wandb`
    wandb_project: str = "blockdraft"
    progress: bool = True  # tqdm progress bar (rank 0)


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp"] = "ddp"  # how torchrun processes share the drafter
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, else gloo
    # collective timeout: ranks wait while rank 0 saves; torch's 10 minutes can be too short
    timeout_minutes: float = 60.0


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, tensorboard/, checkpoints/, best/, final/
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun: the local rank's GPU)
    # auto: bf16 autocast on CUDA, fp32 on CPU; bf16: also on CPU
    amp: Literal["auto", "off", "bf16"] = "auto"
    num_anchors: int = 512  # anchor blocks sampled per sequence per step (DFlash recipe)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfigSection = field(default_factory=DrafterConfigSection)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "objective": self.objective.to_dict()}


def drafted_blocks(cfg: TrainConfig) -> int:
    """Blocks drafted with gradient per sequence: a rounds objective's `max_anchors` round
    starts, a block objective's `num_anchors`; never more than a sequence has positions."""
    rounds = cfg.objective.kind.is_rounds_objective
    return min(cfg.objective.max_anchors if rounds else cfg.num_anchors, cfg.data.max_seq_len)


# --- building from plain data ------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    exact = {
        type(None): value is None,
        bool: isinstance(value, bool),
        int: number and isinstance(value, int),
        str: isinstance(value, str),
    }
    if exact.get(tp):
        return value
    if tp is float:
        if number:
            return float(value)
        if isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (section), got {value!r}")
        return tp.from_dict(value, key) if hasattr(tp, "from_dict") else _build(tp, value, key)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(
                f"unknown config key {key!r} (valid here: {', '.join(sorted(names))})"
            )
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`optim.lr=3e-4` -> ("optim.lr", 0.0003); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def validate(cfg: TrainConfig) -> None:
    """Semantic checks the types cannot express; each error names its key."""
    checks: list[tuple[bool, str]] = [
        (cfg.drafter.block_size >= 2, "drafter.block_size: must be >= 2 (anchor + >= 1 proposal)"),
        (cfg.drafter.num_layers >= 1, "drafter.num_layers: must be >= 1"),
        (
            not (cfg.drafter.init_from and cfg.drafter.init_layers_from_target),
            "drafter.init_layers_from_target: not with drafter.init_from (it has its own layers)",
        ),
        (cfg.num_anchors >= 1, "num_anchors: must be >= 1"),
        (cfg.optim.lr > 0, "optim.lr: must be > 0"),
        (len(cfg.optim.betas) == 2, "optim.betas: must be two numbers"),
        (cfg.optim.grad_accum >= 1, "optim.grad_accum: must be >= 1"),
        (cfg.optim.batch_size >= 1, "optim.batch_size: must be >= 1"),
        (cfg.optim.max_steps is None or cfg.optim.max_steps >= 1, "optim.max_steps: must be >= 1"),
        (cfg.optim.epochs > 0, "optim.epochs: must be > 0"),
        (0.0 <= cfg.optim.warmup_ratio < 1.0, "optim.warmup_ratio: must be in [0, 1)"),
        (cfg.optim.grad_clip >= 0, "optim.grad_clip: must be >= 0"),
        (0.0 <= (cfg.data.eval_split or 0.0) < 1.0, "data.eval_split: must be in [0, 1)"),
        (cfg.data.max_seq_len >= 2, "data.max_seq_len: must be >= 2"),
        (
            not getattr(cfg.objective.params, "soft_target_weight", 0.0)
            or cfg.drafter.arch == "dflash",
            "objective.soft_target_weight: only for a parallel drafter (drafter.arch: dflash)",
        ),
        (
            cfg.data.train_subset is None or cfg.data.train_subset >= 1,
            "data.train_subset: must be >= 1 (or null: every rollout)",
        ),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last: must be >= 1"),
        (cfg.logging.every >= 1, "logging.every: must be >= 1"),
        (cfg.distributed.timeout_minutes > 0, "distributed.timeout_minutes: must be > 0"),
        (bool(cfg.data.train_rollouts), "data.train_rollouts: required (a rollout directory)"),
        (cfg.seed >= 0, "seed: must be >= 0"),
        (
            cfg.optim.batch_size % max(1, cfg.optim.grad_accum) == 0,
            f"optim.batch_size: {cfg.optim.batch_size} is not divisible by optim.grad_accum="
            f"{cfg.optim.grad_accum} (each optimizer step splits the batch into equal "
            "micro-batches)",
        ),
        (cfg.optim.weight_decay >= 0, "optim.weight_decay: must be >= 0"),
        (0.0 <= cfg.optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio: must be in [0, 1]"),
        (
            cfg.optim.warmup_steps is None or cfg.optim.warmup_steps >= 0,
            "optim.warmup_steps: must be >= 0",
        ),
        (all(0.0 <= b < 1.0 for b in cfg.optim.betas), "optim.betas: each must be in [0, 1)"),
        (cfg.drafter.markov_rank >= 1, "drafter.markov_rank: must be >= 1"),
        (
            cfg.drafter.draft_vocab_size is None or cfg.drafter.draft_vocab_size >= 1,
            "drafter.draft_vocab_size: must be >= 1 (or null for the full vocabulary)",
        ),
        (
            cfg.target.layer_ids is None
            or (len(cfg.target.layer_ids) > 0 and min(cfg.target.layer_ids) >= 0),
            "target.layer_ids: must be a non-empty list of layer indices >= 0 (or null)",
        ),
        (cfg.eval.every >= 0, "eval.every: must be >= 0 (0 = only at the end)"),
        (cfg.eval.max_rollouts >= 1, "eval.max_rollouts: must be >= 1"),
        (cfg.checkpoint.save_every >= 0, "checkpoint.save_every: must be >= 0 (0 = only final)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")


def _numbers(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every number in the config, lists' items included."""
    if dataclasses.is_dataclass(node):
        return [
            item
            for f in dataclasses.fields(node)
            for item in _numbers(getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name)
        ]
    if isinstance(node, list):
        return [item for i, v in enumerate(node) for item in _numbers(v, f"{prefix}[{i}]")]
    return [(prefix, node)] if isinstance(node, (int, float)) else []


def config_from_dict(data: dict[str, Any] | None, overrides: list[str] = ()) -> TrainConfig:
    """Build and validate a `TrainConfig` from a nested dict plus dotted overrides."""
    merged = copy.deepcopy(dict(data or {}))
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(merged, key, value)
    cfg = _build(TrainConfig, merged)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or start from defaults when `path` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
            what = getattr(exc, "problem", None) or (str(exc).splitlines() or ["parse error"])[0]
            raise ConfigError(f"{where}: not valid YAML ({what})") from None
        except UnicodeDecodeError as exc:
            line = p.read_bytes()[: exc.start].count(b"\n") + 1
            raise ConfigError(f"{p}:{line}: not UTF-8 text") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
        # a run's own run.yaml carries a `provenance` block (version, git sha): informational,
        # so a finished run's run.yaml can be fed straight back to `blockdraft train --config`
        data.pop("provenance", None)
    return config_from_dict(data, overrides)


def dump_yaml(cfg: TrainConfig, extra: dict[str, Any] | None = None) -> str:
    """The resolved config (plus provenance such as version and git sha) as YAML."""
    return yaml.safe_dump({**(extra or {}), **cfg.to_dict()}, sort_keys=False)
