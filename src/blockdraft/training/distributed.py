"""Process-group plumbing for data-parallel training under `torchrun`.

Everything the trainer needs to know about other processes goes through this module, so
the loop reads the same with 1 process or N: rank/world size, the device of this rank,
summing a number over all ranks, and wrapping the trainable module (DDP, or FSDP2 for
drafters too large to replicate). A single process (no `WORLD_SIZE` in the environment)
never initialises a process group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistContext:
    """Where this process sits: `rank` of `world_size`, and its compute device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialised: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present; under torchrun, plain `cuda` means this rank's GPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        spec = f"cuda:{local_rank}"
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
    return device


def init_distributed(device_spec: str = "auto", backend: str = "auto") -> DistContext:
    """Join the torchrun process group if there is one; otherwise a 1-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local_rank)
    if world <= 1:
        return DistContext(0, 1, 0, device, initialised=False)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    already = dist.is_initialized()
    if not already:
        dist.init_process_group(backend=backend)
    return DistContext(rank, world, local_rank, device, initialised=not already)


def shutdown(ctx: DistContext) -> None:
    """Leave the process group we created (never one a caller created)."""
    if ctx.initialised and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over ranks (a no-op copy for one process)."""
    out = value.detach().clone()
    if ctx.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max_flag(flag: bool, ctx: DistContext, device: torch.device) -> bool:
    """True on every rank if it is True on any rank (e.g. a non-finite loss somewhere)."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def broadcast_object(obj: object, ctx: DistContext) -> object:
    """Rank 0's value of a small picklable object, on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_module(module: nn.Module, ctx: DistContext, strategy: str = "ddp") -> nn.Module:
    """Make `module` data-parallel: DDP (replicated) or FSDP2 `fully_shard` (sharded).

    Both average gradients over ranks; the trainer rescales them so the result equals one
    process on the same global batch (see `loop.py`).
    """
    if not ctx.distributed:
        return module
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module)
        return module
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, broadcast_buffers=False
    )


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on accumulation micro-steps (only the last one syncs)."""
    if not enabled:
        yield
        return
    if isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield
