"""Process-group plumbing for data-parallel training under `torchrun`.

Everything the trainer knows about other processes goes through here, so the loop reads
the same with 1 process or N: ranks, collectives, wrapping the drafter (DDP or FSDP2) and
turning FSDP2 shards into the full state checkpoints hold (and back). A single process
(no `WORLD_SIZE`) never initialises a process group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from blockdraft.devices import resolve_device  # the one device resolver of every stage


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


def init_distributed(
    device_spec: str = "auto", backend: str = "auto", timeout_minutes: float | None = None
) -> DistContext:
    """Join the torchrun process group if there is one; otherwise a 1-process context.

    `timeout_minutes` bounds every collective (None: torch's default, 10 minutes)."""
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
        timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, timeout=timeout)
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


def all_reduce_max_flag(flag: bool, ctx: DistContext) -> bool:
    """True on every rank if it is True on any rank."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
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


def all_gather_objects(obj: object, ctx: DistContext) -> list[object]:
    """Every rank's value of a picklable object, in rank order, on every rank (tensors
    travel pickled: keep them small)."""
    if not ctx.distributed:
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def wrap_module(module: nn.Module, ctx: DistContext, strategy: str = "ddp") -> nn.Module:
    """Make `module` data-parallel: DDP (replicated) or FSDP2 `fully_shard` (sharded).

    FSDP2 shards each decoder layer as its own unit (one layer's full weights at a time),
    then the root. The target's frozen embedding and LM head sit in `drafter._shared`, not
    a submodule, so they stay replicated and out of the optimizer, as under DDP.
    """
    if not ctx.distributed:
        return module
    if strategy == "fsdp":
        # lazy: torch.distributed.fsdp takes seconds to import; only FSDP runs need it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns when a wrapped forward returns a view, in case the caller modifies
        # it in place; ours are only read, so the warning is noise on every rank
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        inner = getattr(module, "drafter", module)
        for layer in getattr(inner, "layers", []):
            fully_shard(layer, mesh=mesh)
            _route_context_key_value(layer)
        fully_shard(module, mesh=mesh)
        return module
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, broadcast_buffers=False
    )


def _route_context_key_value(layer: nn.Module) -> None:
    """Let a sharded decoder layer compute the context keys/values outside its `forward`.

    `forward_blocks` calls `layer.self_attn.key_value(context)` before `layer(...)`, where
    FSDP2 has not gathered the weights (and the k/v gradient would miss the layer's
    reduce-scatter). The call goes through an extra FSDP forward method of the layer
    (`register_fsdp_forward_method`); inside `layer.forward` (tracked by a pre/post hook
    pair) the weights are gathered and the original method runs.
    """
    # lazy: torch.distributed.fsdp takes seconds to import; only FSDP runs need it
    from torch.distributed.fsdp import register_fsdp_forward_method

    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "key_value"):
        return
    original = attn.key_value
    depth = [0]  # >0 while layer.forward runs

    def enter(*_: object) -> None:
        depth[0] += 1

    def leave(*_: object) -> None:
        depth[0] -= 1

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave, always_call=True)
    layer.context_key_value = original  # type: ignore[attr-defined]
    register_fsdp_forward_method(layer, "context_key_value")

    def key_value(*args: object, **kwargs: object):
        if depth[0]:
            return original(*args, **kwargs)
        return layer.context_key_value(*args, **kwargs)

    attn.key_value = key_value  # type: ignore[method-assign]


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip to `max_norm` by the *global* gradient norm and return that norm (FSDP2's is a
    DTensor, reduced over ranks: `full_tensor` makes it the global number)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --- FSDP2 checkpoints: full (unsharded) state on rank 0 ------------------------------------
# Checkpoints hold the full weights and optimizer state in the layout DDP writes, so they do
# not depend on the ranks or strategy that wrote them. Gathering is collective.


def _trainable_names(model: nn.Module) -> list[str]:
    """Parameter names in the order the trainer hands parameters to the optimizer."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_model_state(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Full CPU state dict on rank 0 (empty elsewhere); `every_rank`: on every rank, on the
    parameters' device (the sharded evaluation). Collective."""
    # lazy: torch.distributed.checkpoint takes seconds to import; only FSDP runs need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=opts)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimizer state on rank 0, keyed by the optimizer's integer ids like a DDP
    checkpoint (torch keys it by parameter name). Collective."""
    # lazy: torch.distributed.checkpoint takes seconds to import; only FSDP runs need it
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not osd:
        return {}
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    return {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]
        ],
    }


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optim_state: dict,
) -> None:
    """Load full weights and optimizer state into sharded `model`; every rank passes the
    full state and keeps its shard. Collective."""
    # lazy: torch.distributed.checkpoint takes seconds to import; only FSDP runs need it
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    names = _trainable_names(model)
    by_name = {
        "state": {names[int(i)]: v for i, v in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]}
            for g in optim_state["param_groups"]
        ],
    }
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, optimizer, by_name, options=opts)


def unsharded_copy(drafter: nn.Module, state: dict, target, device: torch.device) -> nn.Module:
    """A plain drafter holding the full `state`, bound to `target`: scoring and saving then
    run on ordinary tensors, with no collective inside. Built under `fork_rng`, so its
    throw-away init leaves the training RNG alone."""
    with torch.random.fork_rng(devices=[]):
        twin = type(drafter)(drafter.config)
    twin.load_state_dict(state, strict=True)
    return twin.to(device=device, dtype=drafter.dtype).bind_target(target)


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on accumulation micro-steps (only the last one syncs)."""
    if enabled and isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
    elif enabled and hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield
