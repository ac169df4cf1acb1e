"""Turning a `TrainConfig` into live objects: target, rollouts, drafter, objective, optimizer.

Every check that can fail fails here, before the first step, with a one-line message
naming the config key or file at fault: rollouts made by another target, a sampling mode
that contradicts how the rollouts were generated, an incompatible init checkpoint.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch

from blockdraft.data.mask_records import recorded_masks
from blockdraft.data.rollouts import RolloutSet
from blockdraft.data.rollouts.store import RolloutError, check_target, nested_subset
from blockdraft.devices import resolve_device, resolve_dtype
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.drafters.draft_vocab import most_frequent_tokens
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.errors import BlockdraftError
from blockdraft.objectives.losses import DPaceParams
from blockdraft.serialization.checkpoint import load_drafter
from blockdraft.targets.mask_token import MaskTokenError, load_target_with_mask
from blockdraft.targets.registry import TargetLoadError, load_target
from blockdraft.training.config import (
    ConfigError,
    DataConfig,
    TrainConfig,
    drafted_blocks,
)


class TrainSetupError(BlockdraftError, ValueError):
    """Inputs of a training run that do not fit together (one line, names the culprit)."""


@dataclass
class RolloutData:
    rollouts: list  # materialised Rollout records (token ids are small; shards load once)
    settings: Any  # SamplingSettings the rollouts were generated with
    directory: str


def load_target_for(cfg: TrainConfig, device: torch.device):
    """The frozen target named by `target.name` (registry name, HF id or local path);
    `target.dtype: auto` is bfloat16 on CUDA (half the memory; the drafter reads bf16
    features under autocast anyway), float32 elsewhere (CPU bf16 matmuls are slow)."""
    dtype = resolve_dtype(cfg.target.dtype, device)
    recorded = recorded_masks(
        [d for d in (cfg.data.train_rollouts, cfg.data.eval_rollouts) if d],
        [cfg.drafter.init_from] if cfg.drafter.init_from else [],
    )
    try:
        target = load_target_with_mask(
            cfg.target.name,
            mask_token=cfg.target.mask_token,
            recorded=recorded,
            loader=load_target,
            device=device,
            dtype=dtype,
            progress=cfg.logging.progress,
        )
    except MaskTokenError as exc:
        raise ConfigError(f"target.mask_token: {exc}") from None
    except TargetLoadError as exc:
        if not exc.custom_code:
            raise ConfigError(f"target.name: {exc}") from None
        raise ConfigError(
            f"target.name: {cfg.target.name!r} loads only with the model's own code "
            "(trust_remote_code), which `blockdraft train` does not run; train on a model "
            "transformers implements"
        ) from None
    if cfg.target.layer_ids is not None:  # checked here: the layer count is known now
        bad = [i for i in cfg.target.layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(
                f"target.layer_ids: {bad} out of range for the {target.num_layers}-layer "
                f"target {cfg.target.name!r} (valid: 0..{target.num_layers - 1})"
            )
        target.layer_ids = list(cfg.target.layer_ids)
    return target


def check_device(cfg: TrainConfig) -> None:
    """`device` names a device this machine has (before any process group or file)."""
    try:
        resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"device: {str(exc).splitlines()[0].removeprefix('device ')}") from None


def check_batch_split(cfg: TrainConfig, world_size: int) -> None:
    """The global batch splits into equal micro-batches on every process."""
    parts = world_size * cfg.optim.grad_accum
    if cfg.optim.batch_size % parts:
        raise ConfigError(
            f"optim.batch_size: {cfg.optim.batch_size} is not divisible by world size "
            f"{world_size} x optim.grad_accum {cfg.optim.grad_accum} = {parts}"
        )


def check_against_target(cfg: TrainConfig, target, say=print) -> None:
    """Settings that must fit the target's shapes, checked before anything is written.
    A `data.max_seq_len` beyond the target's context is refused, except the default,
    which is lowered to it with a note (the defaults must train any target)."""
    context = target.context_length
    default = DataConfig().max_seq_len
    if context is not None and cfg.data.max_seq_len == default and default > context:
        say(
            f"note: data.max_seq_len {default} (the default) is longer than the context of "
            f"target {cfg.target.name!r}; using its {context} tokens"
        )
        cfg.data.max_seq_len = context
    if context is not None and cfg.data.max_seq_len > context:
        raise ConfigError(
            f"data.max_seq_len: {cfg.data.max_seq_len} is longer than the context of target "
            f"{cfg.target.name!r} ({context} tokens, max_position_embeddings)"
        )
    vocab = cfg.drafter.draft_vocab_size
    if vocab is not None and vocab > target.vocab_size:
        raise ConfigError(
            f"drafter.draft_vocab_size: {vocab} is larger than the vocabulary of target "
            f"{cfg.target.name!r} ({target.vocab_size} tokens)"
        )


def _open_checked(directory: str, key: str, target, allow_incomplete: bool = False):
    """Open a rollout directory (whole, intact, complete) and check this target made it."""
    if not directory:
        raise ConfigError(f"{key}: required (a rollout directory)")
    path = Path(directory)
    if not (path / "manifest.json").is_file():
        raise TrainSetupError(f"{key}: {path} is not a rollout directory (no manifest.json)")
    try:
        rs = RolloutSet.open(path, allow_incomplete=allow_incomplete)
        check_target(rs, target)
    except RolloutError as exc:
        raise TrainSetupError(f"{key}: {exc}") from None
    return rs


def _materialise(rs, key: str, limit: int | None = None) -> RolloutData:
    n = len(rs) if limit is None else min(limit, len(rs))
    if n == 0:
        raise TrainSetupError(
            f"{key}: {rs.directory} holds no finished rollouts (or the split left none)"
        )
    rows = [rs[i] for i in range(n)]  # in stored order: each shard is decoded once
    return RolloutData(rows, rs.settings, str(rs.directory))


def load_train_eval(cfg: TrainConfig, target) -> tuple[RolloutData, RolloutData | None]:
    """Training rollouts and the held-out set (its own directory or a split by prompt id),
    then `data.train_subset` of the training ones."""
    d = cfg.data
    train_set = _open_checked(d.train_rollouts, "data.train_rollouts", target, d.allow_incomplete)
    ev = None
    if d.eval_rollouts:
        ev = _materialise(
            _open_checked(d.eval_rollouts, "data.eval_rollouts", target, d.allow_incomplete),
            "data.eval_rollouts",
            cfg.eval.max_rollouts,
        )
    elif (d.eval_split or 0.0) > 0:
        train_set, held_out = train_set.split(d.eval_split, seed=cfg.seed)
        ev = _materialise(held_out, "data.eval_split", cfg.eval.max_rollouts)
    if d.train_subset is not None:
        if d.train_subset > len(train_set):
            raise TrainSetupError(
                f"data.train_subset: {d.train_subset} but {train_set.directory} has "
                f"{len(train_set)} training rollouts (after the held-out split)"
            )
        train_set = train_set.subset(nested_subset(train_set.prompt_ids, d.train_subset))
    train = _materialise(train_set, "data.train_rollouts")
    soft = getattr(cfg.objective.params, "soft_target_weight", 0.0)
    if soft > 0 and any(r.topk_ids is None for r in train.rollouts):
        raise TrainSetupError(
            f"objective.soft_target_weight: {train_set.directory} stores no top-k distribution "
            "(write the rollouts with `blockdraft rollout --store-topk N`)"
        )
    return train, ev


def resolve_mode(cfg: TrainConfig, train: RolloutData, evaluation: RolloutData | None) -> str:
    """greedy/sampling from the rollouts; refuse a config or eval set that disagrees."""
    mode = "greedy" if train.settings.greedy else "sampling"
    how = "greedily" if mode == "greedy" else f"at temperature {train.settings.temperature}"
    if cfg.objective.mode != "auto" and cfg.objective.mode != mode:
        raise ConfigError(
            f"objective.mode: {cfg.objective.mode!r} but the rollouts in {train.directory} were "
            f"generated {how}"
        )
    if evaluation is not None:
        ev = evaluation.settings
        tr = train.settings
        if (ev.temperature, ev.top_p, ev.top_k) != (tr.temperature, tr.top_p, tr.top_k):
            raise TrainSetupError(
                f"data.eval_rollouts: sampled with T={ev.temperature}, top_p={ev.top_p}, "
                f"top_k={ev.top_k} but "
                f"training rollouts with T={tr.temperature}, top_p={tr.top_p}, top_k={tr.top_k}"
            )
    return mode


def build_objective(cfg: TrainConfig, mode: str):
    """The configured objective for rollouts of `mode` (validated by `config.validate`)."""
    return cfg.objective.build(mode)


def dpace_profile_args(cfg: TrainConfig) -> tuple[float, str]:
    """(alpha, variant) used for the logged D-PACE weight profile: the run's own for a
    D-PACE run, D-PACE's defaults otherwise."""
    p = cfg.objective.params
    p = p if isinstance(p, DPaceParams) else DPaceParams()
    return p.alpha, p.variant


def build_drafter(cfg: TrainConfig, target, train: RolloutData, device: torch.device):
    """A fresh drafter (seeded) or the `drafter.init_from` checkpoint, bound to the target."""
    d = cfg.drafter
    if d.init_from:
        if not Path(d.init_from).is_dir():
            raise TrainSetupError(f"drafter.init_from: {d.init_from} is not a checkpoint directory")
        try:
            drafter = load_drafter(d.init_from, target, device=device)
        except (ValueError, FileNotFoundError) as exc:
            raise TrainSetupError(f"drafter.init_from: {exc}") from None
        if drafter.config.block_size != d.block_size:
            raise ConfigError(
                f"drafter.block_size: {d.block_size} but drafter.init_from has "
                f"block_size {drafter.config.block_size}"
            )
        return drafter.float().to(device)
    try:  # a bad combination (e.g. a conv group size not dividing the width): one line
        dcfg = DrafterConfig.for_target(
            target,
            num_layers=d.num_layers,
            block_size=d.block_size,
            arch=d.arch,
            markov_rank=d.markov_rank,
            draft_vocab_size=d.draft_vocab_size,
            lookup_inputs=d.lookup_inputs,
            selector_rank=d.selector_rank,
            selector_top_k=d.selector_top_k,
            conv_kernel_size=d.conv_kernel_size,
            conv_group_size=d.conv_group_size,
        )
        torch.manual_seed(cfg.seed)
        classes = {"semi_ar": SemiARDrafter, "dflash2": DFlash2Drafter}
        drafter = classes.get(d.arch, BlockDrafter)(dcfg)
        if d.init_layers_from_target:
            drafter.copy_target_layers(target)
    except ValueError as exc:  # e.g. a conv group size that does not divide the width
        raise TrainSetupError(f"drafter: {exc}") from None
    if d.draft_vocab_size is not None:
        ids = most_frequent_tokens(
            (torch.cat([r.prompt_ids, r.response_ids]) for r in train.rollouts),
            d.draft_vocab_size,
            target.vocab_size,
            always_include=target.stop_token_ids,
        )
        drafter.set_draft_vocab(ids)
    return drafter.to(device).bind_target(target)


def build_optimizer(cfg: TrainConfig, params, total: int):
    """AdamW + warm-up then cosine/linear/constant decay (a LambdaLR, so its state saves)."""
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    warm = o.warmup_steps if o.warmup_steps is not None else int(round(o.warmup_ratio * total))
    floor = o.min_lr_ratio

    def factor(step: int) -> float:
        if warm > 0 and step < warm:
            return (step + 1) / warm
        if o.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        if o.schedule == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# The largest values the CPU configs in configs/ use; a config above one of them was sized
# for a GPU (configs/dflash-qwen3-*.yaml): a CPU run of it is named in one line.
CPU_SIZED = {"data.max_seq_len": 1024, "drafter.num_layers": 2, "optim.batch_size": 16}
CPU_BLOCK_QUERIES = 4096  # blocks x block_size per sequence (tiny.yaml: 512 x 8)


def gpu_sized_settings(cfg: TrainConfig) -> list[str]:
    """`key=value` of each setting above what the CPU configs use (`CPU_SIZED`)."""
    values = {key: attrgetter(key)(cfg) for key in CPU_SIZED}
    out = [f"{k}={v}" for k, v in values.items() if v > CPU_SIZED[k]]
    key = "objective.max_anchors" if cfg.objective.kind.is_rounds_objective else "num_anchors"
    blocks = drafted_blocks(cfg)
    if blocks * cfg.drafter.block_size > CPU_BLOCK_QUERIES:
        out.insert(1, f"{key}={blocks} x drafter.block_size={cfg.drafter.block_size}")
    return out


def cpu_fallback_note(cfg: TrainConfig, device: torch.device) -> str | None:
    """The one line a GPU-sized config prints when `device: auto` found no GPU: the silent
    CPU fallback would run it in float32 for days; the line names what to override."""
    sized = gpu_sized_settings(cfg)
    # data.max_seq_len is a cap (short rollouts cost the same under any cap): alone it
    # does not make a run GPU-sized (the demo trains under the default 2048 on a CPU)
    costly = [s for s in sized if not s.startswith("data.max_seq_len=")]
    if cfg.device != "auto" or device.type != "cpu" or not costly:
        return None
    precision = "under bf16 autocast (amp: bf16)" if cfg.amp == "bf16" else "in float32"
    return (
        f"note: device auto found no CUDA device: training on the CPU {precision} (amp and "
        f"target.dtype auto mean bf16 on a GPU) with GPU-sized settings {', '.join(sized)}; "
        "expect it to be slow, or override them for a CPU run"
    )


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA when auto or asked; on CPU only when asked (`auto` keeps a CPU
    run in fp32, repeatable across machines; bf16 pays only with bf16 matrix units, AMX)."""
    if cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None
