"""The optimizer-step loop: micro-batches, global normalisation, clipping, logging, saving.

One optimizer step = the global batch of `optim.batch_size` sequences, split over
`world_size` processes x `grad_accum` micro-batches. Each micro-batch back-propagates its
un-normalised loss numerator (`steps/interface.py`); after the last one the gradient
is multiplied by `world_size / global_denominator` (DDP/FSDP averaged over ranks, we
want the sum over the batch divided by the batch's denominator). The result equals one
process on the whole batch up to float summation order.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from blockdraft.training.batching import collate, global_batch_indices, micro_batches, total_steps
from blockdraft.training.builders import amp_dtype, build_optimizer, dpace_profile_args
from blockdraft.training.distributed import (
    DistContext,
    all_reduce_sum,
    clip_grad_norm,
    no_grad_sync,
)
from blockdraft.training.steps import MicroStep, StepInputs, StepStats, micro_step_for


class NonFiniteLossError(RuntimeError):
    """Raised when a step's loss or gradient is NaN/inf; the run stops without saving it."""


@dataclass
class LoopParts:
    """Everything the loop touches, built by `trainer.py` (and `synthetic.py`)."""

    cfg: Any
    ctx: DistContext
    inputs: StepInputs  # what each micro-step reads besides its batch
    micro_step: MicroStep  # the objective family's step (`steps.micro_step_for`)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rollouts: list
    pad_id: int
    total_steps: int
    amp_dtype: torch.dtype | None
    bar_position: int = 0  # the progress bar's terminal line (trainings side by side)
    # evaluate(step), save(step, kind), log(step, dict)
    hooks: dict[str, Any] = field(default_factory=dict)

    @property
    def drafter(self) -> nn.Module:
        return self.inputs.drafter


def build_loop_parts(
    cfg: Any, ctx: DistContext, target: Any, data: Any, *, drafter, fwd, features, objective, mode
) -> LoopParts:
    """The parts of a run of `drafter` (called as `fwd`, maybe wrapped) on `data`
    (`builders.RolloutData`), with a fresh optimizer and schedule; no hooks yet."""
    steps = total_steps(
        len(data.rollouts), cfg.optim.batch_size, cfg.optim.epochs, cfg.optim.max_steps
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(cfg, params, steps)
    alpha, variant = dpace_profile_args(cfg)
    inputs = StepInputs(
        fwd=fwd,
        drafter=drafter,
        features=features,
        objective=objective,
        settings=data.settings,
        seed=cfg.seed,
        mode=mode,
        stop_token_ids=list(target.stop_token_ids),
        num_anchors=cfg.num_anchors,
        profile_alpha=alpha,
        profile_variant=variant,
    )
    pad = getattr(target.tokenizer, "pad_token_id", None)
    return LoopParts(
        cfg=cfg,
        ctx=ctx,
        inputs=inputs,
        micro_step=micro_step_for(objective),
        optimizer=optimizer,
        scheduler=scheduler,
        rollouts=data.rollouts,
        pad_id=int(pad if pad is not None else (target.stop_token_ids or [0])[0]),
        total_steps=steps,
        amp_dtype=amp_dtype(cfg, ctx.device),
    )


def train_step(parts: LoopParts, step: int, want_acc: bool) -> dict[str, Any]:
    """Run optimizer step `step` (0-based). Returns metrics (global over ranks)."""
    cfg, ctx = parts.cfg, parts.ctx
    accum = cfg.optim.grad_accum
    indices = global_batch_indices(len(parts.rollouts), cfg.optim.batch_size, step, cfg.seed)
    mine = micro_batches(indices, ctx.rank, ctx.world_size, accum)
    params = [p for p in parts.drafter.parameters() if p.requires_grad]
    parts.optimizer.zero_grad(set_to_none=True)
    k = parts.drafter.config.block_size - 1
    stats = StepStats(k)
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    tokens = 0
    autocast = (
        torch.autocast(ctx.device.type, dtype=parts.amp_dtype)
        if parts.amp_dtype is not None
        else contextlib.nullcontext()
    )
    for i, ids in enumerate(mine):
        batch = collate(
            [parts.rollouts[j] for j in ids], ids, parts.pad_id, cfg.data.max_seq_len
        ).to(ctx.device)
        with no_grad_sync(parts.inputs.fwd, enabled=ctx.distributed and i < accum - 1):
            with autocast:
                out = parts.micro_step(parts.inputs, batch, step, want_acc)
            out.numerator.backward()
        num += float(out.numerator.detach())
        den += out.denominator
        stats.add(out.stats)
        tokens += out.tokens
    totals = all_reduce_sum(
        torch.stack([num, den, torch.tensor(float(tokens), dtype=torch.float64)]).to(ctx.device),
        ctx,
    )
    g_num, g_den, g_tokens = (float(x) for x in totals.cpu())
    scale = ctx.world_size / g_den if g_den > 0 else 0.0
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    loss = g_num / g_den if g_den > 0 else 0.0
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    grad_norm = clip_grad_norm(params, clip)  # global norm, also over FSDP shards
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        raise NonFiniteLossError(
            f"non-finite {what} at step {step + 1} "
            f"(loss={loss}, grad_norm={grad_norm}); stopping without saving this step"
        )
    lr = parts.optimizer.param_groups[0]["lr"]
    parts.optimizer.step()
    parts.scheduler.step()
    g_stats = StepStats.unpack(all_reduce_sum(stats.packed().to(ctx.device), ctx), k)
    metrics: dict[str, Any] = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(g_tokens),
    }
    if want_acc:
        metrics["acc_k"] = (g_stats.acc_correct / g_stats.acc_count.clamp_min(1)).tolist()
    if g_stats.profile_blocks > 0:
        profile = (g_stats.profile_sum / g_stats.profile_blocks).tolist()
        metrics["dpace_weight_profile"] = profile
        metrics["dpace_weight_centroid"] = sum((j + 1) * w for j, w in enumerate(profile))
    return metrics


def run_loop(parts: LoopParts, start_step: int, progress_state: Any) -> None:
    """Steps `start_step .. total_steps-1` with logging, evaluation and checkpoints."""
    cfg, ctx = parts.cfg, parts.ctx
    hooks = parts.hooks
    bar = tqdm(
        total=parts.total_steps,
        initial=start_step,
        unit="step",
        desc=f"train {cfg.objective.name}",
        disable=not (ctx.is_main and cfg.logging.progress),
        dynamic_ncols=True,
        position=parts.bar_position,
    )
    t0, tok0 = time.perf_counter(), progress_state.tokens_seen
    try:
        for step in range(start_step, parts.total_steps):
            done = step + 1
            log_now = done % cfg.logging.every == 0 or done == parts.total_steps
            parts.drafter.train()
            metrics = train_step(parts, step, want_acc=log_now)
            progress_state.step = done
            progress_state.tokens_seen += metrics["tokens"]
            rate = (progress_state.tokens_seen - tok0) / max(time.perf_counter() - t0, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{rate:.0f}")
            if log_now:
                metrics["tokens_per_s"] = rate
                metrics["tokens_seen"] = progress_state.tokens_seen
                hooks["log"](done, metrics)
            if cfg.eval.every and done % cfg.eval.every == 0 and done != parts.total_steps:
                hooks["evaluate"](done)
            if (
                cfg.checkpoint.save_every
                and done % cfg.checkpoint.save_every == 0
                and done != parts.total_steps
            ):
                hooks["save"](done, "step")
    finally:
        bar.close()
