"""`train(config)`: build everything, resume if asked, run the loop, save best and final.

Output layout of a run directory:

    run_dir/run.yaml            resolved config + package version + git sha
    run_dir/metrics.jsonl       one JSON object per log/eval event (read by the report)
    run_dir/tensorboard/        the same metrics for tensorboard
    run_dir/checkpoints/step-N/ the last `checkpoint.keep_last` step checkpoints
    run_dir/best/               best held-out offline MAL so far
    run_dir/final/              the finished drafter

Only rank 0 writes files; every rank runs the same steps on its share of each batch.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch

from blockdraft import __version__
from blockdraft.training import state as ckpt
from blockdraft.training.batching import total_steps
from blockdraft.training.config import TrainConfig, dump_yaml
from blockdraft.training.distributed import (
    DistContext,
    barrier,
    broadcast_object,
    full_model_state,
    full_optimizer_state,
    init_distributed,
    load_full_state,
    shutdown,
    unsharded_copy,
    wrap_module,
)
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.evaluate import evaluate_mal
from blockdraft.training.logging import MetricsLogger, truncate_metrics
from blockdraft.training.loop import LoopParts, NonFiniteLossError, run_loop
from blockdraft.training.setup import (
    TrainSetupError,
    amp_dtype,
    build_drafter,
    build_objective,
    build_optimizer,
    dpace_profile_args,
    load_target_for,
    load_train_eval,
    resolve_mode,
)


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_yaml(cfg: TrainConfig, ctx: DistContext) -> str:
    return dump_yaml(
        cfg,
        {
            "provenance": {
                "blockdraft_version": __version__,
                "git_sha": git_sha(),
                "torch_version": str(torch.__version__),
                "world_size": ctx.world_size,
            }
        },
    )


def _pad_id(target) -> int:
    pad = getattr(target.tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else (target.stop_token_ids or [0])[0])


def train(config: TrainConfig, *, target: Any = None, resume: bool = False) -> Path:
    """Train a drafter as configured; returns the `final/` checkpoint directory.

    `target` lets callers (tests, notebooks) pass an already loaded `Target` instead of
    `config.target.name`. `resume=True` continues from the newest complete step
    checkpoint in `run_dir` exactly (same data order, anchors, optimizer and RNG state).
    """
    cfg = config
    ctx = init_distributed(cfg.device, cfg.distributed.backend)
    try:
        return _train(cfg, ctx, target, resume)
    finally:
        shutdown(ctx)


def _train(cfg: TrainConfig, ctx: DistContext, target: Any, resume: bool) -> Path:
    run_dir = Path(cfg.run_dir)
    # FSDP2: parameters are shards, so saving and evaluating first gather the full state
    # (collectively, on every rank) and rank 0 works on an unsharded copy of the drafter.
    sharded = cfg.distributed.strategy == "fsdp" and ctx.distributed
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.recover_interrupted_swaps(run_dir)
    barrier(ctx)
    resume_from = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and resume_from is None and ctx.is_main:
        print(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
    if not resume and ckpt.step_checkpoints(run_dir):
        raise TrainSetupError(
            f"run_dir: {run_dir} already has checkpoints; pass --resume or choose another run_dir"
        )

    if target is None:
        target = load_target_for(cfg, ctx.device)
    target.model.to(ctx.device)
    train_data, eval_data = load_train_eval(cfg, target)
    mode = resolve_mode(cfg, train_data, eval_data)
    objective = build_objective(cfg, mode)
    drafter = build_drafter(cfg, target, train_data, ctx.device)
    fwd = DraftForward(drafter)
    wrapped = wrap_module(fwd, ctx, cfg.distributed.strategy)
    steps = total_steps(
        len(train_data.rollouts), cfg.optim.batch_size, cfg.optim.epochs, cfg.optim.max_steps
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(cfg, params, steps)
    progress = ckpt.TrainerProgress(world_size=ctx.world_size, global_batch=cfg.optim.batch_size)
    if resume_from is not None:
        progress = _restore(resume_from, drafter, optimizer, scheduler, ctx, sharded)
        if progress.global_batch != cfg.optim.batch_size:
            raise TrainSetupError(
                f"optim.batch_size: {cfg.optim.batch_size} but {resume_from} was trained with "
                f"{progress.global_batch}; resume needs the same global batch"
            )
    if progress.step >= steps:
        raise TrainSetupError(
            f"optim: run already finished ({progress.step} of {steps} steps); nothing to resume"
        )
    torch.manual_seed(cfg.seed + progress.step)

    logger = MetricsLogger(
        run_dir,
        enabled=ctx.is_main,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        config=cfg.to_dict(),
    )
    if ctx.is_main:
        if resume_from is not None:
            logger.close()
            truncate_metrics(run_dir, progress.step)
            logger = MetricsLogger(
                run_dir,
                enabled=True,
                tensorboard=cfg.logging.tensorboard,
                wandb=cfg.logging.wandb,
                wandb_project=cfg.logging.wandb_project,
                config=cfg.to_dict(),
            )
        (run_dir / "run.yaml").write_text(run_yaml(cfg, ctx))
    alpha, variant = dpace_profile_args(cfg)
    parts = LoopParts(
        cfg=cfg,
        ctx=ctx,
        target=target,
        drafter=drafter,
        fwd=wrapped,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        rollouts=train_data.rollouts,
        settings=train_data.settings,
        mode=mode,
        pad_id=_pad_id(target),
        total_steps=steps,
        amp_dtype=amp_dtype(cfg, ctx.device),
        profile_alpha=alpha,
        profile_variant=variant,
    )

    def evaluate(step: int) -> float | None:
        """Held-out MAL on rank 0; every rank calls (the FSDP gather and `best/` are collective)."""
        if eval_data is None:
            return None
        full = full_model_state(drafter) if sharded else None
        mal = None
        if ctx.is_main:
            model = unsharded_copy(drafter, full, target, ctx.device) if sharded else drafter
            mal = evaluate_mal(model, target, eval_data.rollouts, eval_data.settings)
            del model, full
            logger.log(
                step, {"eval_mal": mal, "eval_rollouts": len(eval_data.rollouts)}, event="eval"
            )
        barrier(ctx)
        mal = broadcast_object(mal, ctx)
        if progress.best_mal is None or mal > progress.best_mal:
            progress.best_mal, progress.best_step = mal, step
            if step > 0:
                save(step, "best")
        return mal

    def save(step: int, kind: str) -> None:
        """Write a checkpoint from rank 0; every rank calls (FSDP gathering is collective)."""
        model, optim_state = drafter, None
        if sharded:
            full, optim_state = full_model_state(drafter), full_optimizer_state(drafter, optimizer)
            if ctx.is_main:
                model = unsharded_copy(drafter, full, target, torch.device("cpu"))
        if ctx.is_main:
            _write(step, kind, model, optim_state)
        barrier(ctx)

    def _write(step: int, kind: str, model, optim_state: dict | None) -> None:
        path = {
            "step": run_dir / "checkpoints" / f"step-{step}",
            "best": run_dir / "best",
            "final": run_dir / "final",
        }[kind]
        extra = {
            "objective": cfg.objective.name,
            "step": step,
            "mode": mode,
            "target": target.name,
            "best_mal": progress.best_mal,
        }
        from blockdraft.models.checkpoint import save_drafter

        tensors = {
            "optimizer": optimizer.state_dict() if optim_state is None else optim_state,
            "scheduler": scheduler.state_dict(),
            "rng": ckpt.rng_state(),
        }
        ckpt.write_checkpoint_dir(
            path, lambda p: save_drafter(model, p, extra), tensors, progress, run_yaml(cfg, ctx)
        )
        if kind == "step":
            ckpt.prune_checkpoints(run_dir, cfg.checkpoint.keep_last)

    parts.hooks = {"log": logger.log, "evaluate": evaluate, "save": save}
    try:
        if eval_data is not None and cfg.eval.at_start and progress.step == 0:
            evaluate(0)
        try:
            run_loop(parts, progress.step, progress)
        except NonFiniteLossError as exc:
            last = ckpt.latest_checkpoint(run_dir)
            where = (
                f"last good checkpoint kept: {last}"
                if last
                else "no checkpoint was written before it"
            )
            raise NonFiniteLossError(f"{exc}; {where}") from None
        evaluate(progress.step)
        final = run_dir / "final"
        save(progress.step, "final")
        if cfg.checkpoint.save_every:
            save(progress.step, "step")  # so a later --resume with more steps has a start point
    finally:
        logger.close()
    return final


def _restore(
    path: Path, drafter, optimizer, scheduler, ctx: DistContext, sharded: bool = False
) -> ckpt.TrainerProgress:
    """Load drafter weights, optimizer, scheduler and RNG state from a step checkpoint.

    Checkpoints are full-state whatever wrote them; with FSDP each rank keeps its shard.
    """
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    tensors = ckpt.read_trainer_tensors(path)
    if sharded:
        load_full_state(drafter, optimizer, state, tensors["optimizer"])
    else:
        drafter.load_state_dict(
            {k: v.to(next(drafter.parameters()).device) for k, v in state.items()}, strict=True
        )
        optimizer.load_state_dict(tensors["optimizer"])
    scheduler.load_state_dict(tensors["scheduler"])
    ckpt.set_rng_state(tensors["rng"])
    progress = ckpt.read_progress(path)
    progress.world_size = ctx.world_size
    return progress
