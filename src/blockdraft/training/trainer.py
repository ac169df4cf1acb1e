"""`train(config)`: build everything, resume if asked, run the loop, save best and final.

The one entry point of `blockdraft train`, the demo and the Python API. Every check runs
before anything is written; rank 0 holds the run directory's lock and writes `run.yaml`,
`metrics.jsonl`, checkpoints, `best/` and `final/` (docs/training.md, "Outputs and
logging"); every rank runs the same steps on its share of each batch.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from blockdraft import __version__
from blockdraft.artifacts import DirectoryInUseError, write_atomic, writer_lock
from blockdraft.errors import os_error_message
from blockdraft.evaluation.scoring import FeatureMemo
from blockdraft.serialization.checkpoint import save_drafter
from blockdraft.threads import flush_denormals
from blockdraft.training import step_checkpoint as ckpt
from blockdraft.training.builders import (
    TrainSetupError,
    build_drafter,
    build_objective,
    check_against_target,
    check_batch_split,
    check_device,
    cpu_fallback_note,
    load_target_for,
    load_train_eval,
    memory_shortfall,
    resolve_mode,
)
from blockdraft.training.config import TrainConfig, dump_yaml
from blockdraft.training.distributed import (
    DistContext,
    all_reduce_max_flag,
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
from blockdraft.training.feature_sources import build_feature_source
from blockdraft.training.logging import MetricsLogger, truncate_metrics
from blockdraft.training.loop import LoopParts, NonFiniteLossError, build_loop_parts, run_loop
from blockdraft.training.resume import check_resumed_config, threads_note


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
                "device": str(ctx.device),  # what `device: auto` resolved to
                # CPU sums split by thread: a resume with another count is not bit-exact
                "cpu_threads": torch.get_num_threads(),
            }
        },
    )


def train(
    config: TrainConfig,
    *,
    target: Any = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_changed: Collection[str] = (),
    bar_position: int = 0,
) -> Path:
    """Train a drafter as configured; returns the `final/` checkpoint directory.

    `target`: an already loaded `Target` instead of `config.target.name`. `resume`
    continues the newest complete step checkpoint exactly; a config that changes what it
    means is refused unless its keys are in `allow_changed` (`training/resume.py`).
    `bar_position`: the progress bar's line when trainings share a terminal.
    """
    cfg = copy.deepcopy(config)  # setup may resolve defaults in it (the caller's stays)
    check_device(cfg)  # a one-line ConfigError, not torch's RuntimeError
    ctx = init_distributed(cfg.device, cfg.distributed.backend, cfg.distributed.timeout_minutes)
    if ctx.device.type == "cpu":  # the objectives' gradients underflow; CPU denormal math is slow
        flush_denormals()
    try:
        with _run_dir_lock(Path(cfg.run_dir), ctx):
            final = _train(cfg, ctx, target, resume, overwrite, allow_changed, bar_position)
            # every rank done before any leaves: a rank tearing gloo down while a peer still
            # has work in flight can abort the peer (not on errors: a failed rank must exit)
            barrier(ctx)
        return final
    finally:
        shutdown(ctx)


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path, ctx: DistContext) -> Iterator[None]:
    """Rank 0 holds `run_dir`'s writer lock for the whole run (only rank 0 writes there);
    every rank learns whether it got it, so a second run is refused on all of them with
    the same line naming the holder's pid."""
    with contextlib.ExitStack() as held:
        refused = None
        if ctx.is_main:
            try:
                ckpt.refuse_foreign_run_dir(run_dir)  # before the lock creates anything
                held.enter_context(writer_lock(run_dir, "a training run"))
            except (DirectoryInUseError, ckpt.RunDirError) as exc:
                refused = str(exc)
            except OSError as exc:  # cannot even create it: every rank must stop, not wait
                refused = f"run_dir: {os_error_message(exc)}"
        refused = broadcast_object(refused, ctx)
        if refused is not None:
            raise ckpt.RunDirError(refused)
        yield


def _train(
    cfg: TrainConfig,
    ctx: DistContext,
    target: Any,
    resume: bool,
    overwrite: bool = False,
    allow_changed: Collection[str] = (),
    bar_position: int = 0,
) -> Path:
    run_dir = Path(cfg.run_dir)
    check_batch_split(cfg, ctx.world_size)  # every check before anything is written
    note = cpu_fallback_note(cfg, ctx.device)
    if note and ctx.is_main:
        print(note)
    resume_from = _prepare_run_dir(run_dir, ctx, resume, overwrite)
    if resume_from is not None:
        check_resumed_config(cfg, Path(resume_from), allow_changed)
        note = threads_note(Path(resume_from), torch.get_num_threads(), ctx.device)
        if note and ctx.is_main:
            print(note, file=sys.stderr)
    if target is None:
        target = load_target_for(cfg, ctx.device)
    target.model.to(ctx.device)
    say = print if ctx.is_main else _quiet  # rank 0 prints setup notes once
    check_against_target(cfg, target, say=say)
    short = memory_shortfall(cfg, ctx.world_size, ctx.device, target.model.config)
    if short:
        raise TrainSetupError(short)
    train_data, eval_data = load_train_eval(cfg, target)
    mode = resolve_mode(cfg, train_data, eval_data)
    objective = build_objective(cfg, mode)
    features = build_feature_source(cfg, target, train_data, objective, mode, say=say)
    drafter = build_drafter(cfg, target, train_data, ctx.device)
    # wrap (DDP / FSDP2 shards the parameters in place) before the optimizer sees them
    fwd = wrap_module(DraftForward(drafter), ctx, cfg.distributed.strategy)
    parts = build_loop_parts(
        cfg, ctx, target, train_data,
        drafter=drafter, fwd=fwd, features=features, objective=objective, mode=mode,
    )  # fmt: skip
    parts.bar_position = bar_position
    # FSDP2: parameters are shards, so saving and evaluating first gather the full state
    # (collectively, on every rank) and rank 0 works on an unsharded copy of the drafter.
    sharded = cfg.distributed.strategy == "fsdp" and ctx.distributed
    progress = _start_progress(parts, resume_from, sharded)
    torch.manual_seed(cfg.seed + progress.step)
    if ctx.is_main and resume_from is not None:
        truncate_metrics(run_dir, progress.step)  # events after the checkpoint are superseded
    logger = MetricsLogger(
        run_dir,
        enabled=ctx.is_main,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        config=cfg.to_dict(),
    )
    if ctx.is_main:
        write_atomic(run_dir / "run.yaml", run_yaml(cfg, ctx).encode())
    run = _TrainingRun(parts, target, progress, logger, eval_data, sharded)
    parts.hooks = {"log": logger.log, "evaluate": run.evaluate, "save": run.save}
    try:
        return run.run()
    finally:
        logger.close()


def _quiet(*_args: Any) -> None:
    """What other ranks print."""


def _prepare_run_dir(
    run_dir: Path, ctx: DistContext, resume: bool, overwrite: bool = False
) -> Path | None:
    """`state.prepare_run_dir` decided by rank 0 for every rank: ranks looking at their
    own disks could resume from different steps and diverge silently. A rank that cannot
    see rank 0's checkpoint stops every rank with one error."""
    decision: tuple[str, Any] = ("ok", None)
    if ctx.is_main:
        try:
            decision = ("ok", ckpt.prepare_run_dir(run_dir, resume=resume, overwrite=overwrite))
        except ckpt.RunDirError as exc:
            decision = ("error", str(exc))
    decision = broadcast_object(decision, ctx)  # also the barrier after rank 0's mkdir
    if decision[0] == "error":
        raise ckpt.RunDirError(decision[1])
    resume_from = decision[1]
    unseen = resume_from is not None and not ckpt.is_complete(Path(resume_from))
    if all_reduce_max_flag(unseen, ctx):
        raise ckpt.RunDirError(
            f"--resume: rank 0 resumes from {resume_from}, which another rank cannot read "
            "whole; every rank (every node) must see the same run_dir (a shared filesystem)"
        )
    return resume_from


def _start_progress(
    parts: LoopParts, resume_from: Path | None, sharded: bool
) -> ckpt.TrainerProgress:
    """Fresh progress, or the resumed checkpoint's (weights, optimizer, RNG restored)."""
    cfg, ctx, steps = parts.cfg, parts.ctx, parts.total_steps
    progress = ckpt.TrainerProgress(world_size=ctx.world_size, global_batch=cfg.optim.batch_size)
    if resume_from is not None:
        progress = _restore(resume_from, parts, sharded)
        if progress.global_batch != cfg.optim.batch_size:
            raise TrainSetupError(
                f"optim.batch_size: {cfg.optim.batch_size} but {resume_from} was trained with "
                f"{progress.global_batch}; resume needs the same global batch"
            )
    if progress.step >= steps:
        raise TrainSetupError(
            f"optim: run already finished ({progress.step} of {steps} steps); nothing to resume"
        )
    return progress


class _TrainingRun:
    """One training run around the loop: evaluations, the loop and checkpoints;
    `evaluate` and `save` are also the loop's hooks. Every rank calls them (FSDP gathers
    the full state collectively); only rank 0 logs and writes."""

    def __init__(
        self,
        parts: LoopParts,
        target: Any,
        progress: ckpt.TrainerProgress,
        logger: MetricsLogger,
        eval_data,
        sharded: bool,
    ) -> None:
        self.parts, self.cfg, self.ctx, self.drafter = parts, parts.cfg, parts.ctx, parts.drafter
        self.target, self.progress, self.logger, self.eval_data = (
            target,
            progress,
            logger,
            eval_data,
        )
        self.run_dir, self.sharded = Path(parts.cfg.run_dir), sharded
        # the held-out rollouts' target features, computed at the first evaluation and
        # reused by the later ones (the target is frozen); CPU only, where memory is cheap
        self.feature_memo = FeatureMemo() if self.ctx.device.type == "cpu" else None

    def run(self) -> Path:
        """Evaluate at the start (if asked), train, evaluate at the end, save `final/`."""
        cfg, progress = self.cfg, self.progress
        if self.eval_data is not None and cfg.eval.at_start and progress.step == 0:
            self.evaluate(0)
        try:
            run_loop(self.parts, progress.step, progress)
        except NonFiniteLossError as exc:
            last = ckpt.latest_checkpoint(self.run_dir)
            where = (
                f"last good checkpoint kept: {last}"
                if last
                else "no checkpoint was written before it"
            )
            raise NonFiniteLossError(f"{exc}; {where}") from None
        self.evaluate(progress.step)
        self.save(progress.step, "final")
        if cfg.checkpoint.save_every:  # so a later --resume with more steps has a start point
            self.save(progress.step, "step")
        return self.run_dir / "final"

    def evaluate(self, step: int) -> float | None:
        """Held-out MAL, every rank scoring its share in the training dtype (collective);
        rank 0 logs it and a new best is saved to `best/`."""
        if self.eval_data is None:
            return None
        ctx, drafter, target, data = self.ctx, self.drafter, self.target, self.eval_data
        model = drafter
        if self.sharded:  # FSDP2: each rank scores with a whole (unsharded) copy
            full = full_model_state(drafter, every_rank=True)
            model = unsharded_copy(drafter, full, target, ctx.device)
            del full
        mal = evaluate_mal(
            model, target, data.rollouts, data.settings, ctx=ctx, amp_dtype=self.parts.amp_dtype,
            memo=self.feature_memo,
        )  # fmt: skip
        del model
        if ctx.is_main:
            self.logger.log(
                step, {"eval_mal": mal, "eval_rollouts": len(data.rollouts)}, event="eval"
            )
        mal = broadcast_object(mal, ctx)  # every rank computed it; rank 0's value is the record
        progress = self.progress
        if progress.best_mal is None or mal > progress.best_mal:
            progress.best_mal, progress.best_step = mal, step
            if step > 0:
                self.save(step, "best")
        return mal

    def save(self, step: int, kind: str) -> None:
        """Write a `step`/`best`/`final` checkpoint from rank 0."""
        model, optim_state = self.drafter, None
        if self.sharded:
            full = full_model_state(self.drafter)
            optim_state = full_optimizer_state(self.drafter, self.parts.optimizer)
            if self.ctx.is_main:
                model = unsharded_copy(self.drafter, full, self.target, torch.device("cpu"))
        if self.ctx.is_main:
            self._write(step, kind, model, optim_state)
        barrier(self.ctx)

    def _write(self, step: int, kind: str, model, optim_state: dict | None) -> None:
        cfg, run_dir = self.cfg, self.run_dir
        path = {
            "step": run_dir / "checkpoints" / f"step-{step}",
            "best": run_dir / "best",
            "final": run_dir / "final",
        }[kind]
        extra = {
            "objective": cfg.objective.name,
            "step": step,
            "mode": self.parts.inputs.mode,
            "target": self.target.name,
            "best_mal": self.progress.best_mal,
        }
        tensors = {
            "optimizer": self.parts.optimizer.state_dict() if optim_state is None else optim_state,
            "scheduler": self.parts.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
        }
        ckpt.write_checkpoint_dir(
            path,
            lambda p: save_drafter(model, p, extra),
            tensors,
            self.progress,
            run_yaml(cfg, self.ctx),
        )
        if kind == "step":
            ckpt.prune_checkpoints(run_dir, cfg.checkpoint.keep_last)


def _restore(path: Path, parts: LoopParts, sharded: bool) -> ckpt.TrainerProgress:
    """Load drafter weights, optimizer, scheduler and RNG state from a step checkpoint
    (full state whatever wrote it; with FSDP each rank keeps its shard)."""
    drafter, optimizer, scheduler = parts.drafter, parts.optimizer, parts.scheduler
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
    changes = apply_optim_settings(parts.cfg, optimizer, scheduler)
    if changes and parts.ctx.is_main:
        print(f"resume: {', '.join(changes)} (the config's, applied from this step on)")
    ckpt.set_rng_state(tensors["rng"])
    progress = ckpt.read_progress(path)
    progress.world_size = parts.ctx.world_size
    return progress


def apply_optim_settings(cfg: TrainConfig, optimizer: Any, scheduler: Any) -> list[str]:
    """The config's `optim.lr`, `betas` and `weight_decay` over a restored optimizer's.

    A loaded optimizer and LambdaLR state carry the hyperparameters of the run that saved
    them, so without this a resume with another `optim.lr` would record the new value in
    run.yaml and keep training with the old one. The schedule's factor at the restored
    step is kept: the learning rate becomes `lr * factor(step)`. Returns what changed,
    `key old -> new`, for the log (empty for an unchanged config: bit-exact resume)."""
    o = cfg.optim
    want = {"lr": float(o.lr), "betas": tuple(o.betas), "weight_decay": float(o.weight_decay)}
    changes: list[str] = []
    for key, value in want.items():
        before = optimizer.param_groups[0]["initial_lr" if key == "lr" else key]
        if (tuple(before) if key == "betas" else before) != value:
            changes.append(f"optim.{key} {before} -> {value}")
    if not changes:
        return []
    for group in optimizer.param_groups:
        group["initial_lr"] = want["lr"]
        group["betas"] = want["betas"]
        group["weight_decay"] = want["weight_decay"]
    scheduler.base_lrs = [want["lr"]] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = want["lr"] * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changes
