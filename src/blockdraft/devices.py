"""`--device` / `--dtype` for every CLI stage that runs a model, resolved in one place.

Why one module: so every stage, the demo and training agree. Device `auto` is this
rank's GPU (`LOCAL_RANK` under torchrun) when there is one, else the CPU; dtype `auto` is
bfloat16 on a GPU (half fp32's memory and bandwidth) and float32 on the CPU (CPU bf16
matmuls are slow, and the tests compare in fp32).
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from blockdraft.errors import BlockdraftError


class DeviceError(BlockdraftError, ValueError):
    """A `--device` / `--dtype` / `--drafter-dtype` value (or the API's) that cannot be used."""


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = "auto, cpu, cuda, cuda:N"  # what every stage runs on (no mps, meta, xpu, ...)
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present; under torchrun, plain `cuda` means this rank's GPU.
    Only `DEVICES`: torch knows more device types (`meta`, `mps`, ...), which blockdraft's
    kernels and loaders do not run on, and its own message lists its internal ones."""
    if not isinstance(spec, str) or not _DEVICE.fullmatch(spec):
        raise ValueError(f"device {spec!r} is not one of {DEVICES}")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        spec = f"cuda:{local_rank}"
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise RuntimeError(
            f"device {spec!r} requested but this machine has {torch.cuda.device_count()} "
            "CUDA device(s)"
        )
    return device


def resolve_dtype(spec: str | None, device: torch.device | str) -> torch.dtype:
    """`auto` (or None): bfloat16 on CUDA, float32 elsewhere; else the named dtype."""
    if spec in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise ValueError(f"dtype {spec!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, str(spec))


def add_device_args(p: argparse.ArgumentParser, what: str = "the target and the drafter") -> None:
    """`--device` and `--dtype` with the shared defaults (`auto`) and help texts."""
    p.add_argument(
        "--device",
        default="auto",
        help=f"device of {what}: auto (this rank's GPU if there is one, else cpu), cpu, "
        "cuda, cuda:N",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help=f"dtype of {what}; auto: bfloat16 on GPU, float32 on CPU",
    )


def add_drafter_dtype_arg(p: argparse.ArgumentParser) -> None:
    """`--drafter-dtype`: the drafters' own dtype where it should differ from `--dtype`."""
    p.add_argument(
        "--drafter-dtype",
        default="auto",
        choices=list(DTYPES),
        help="dtype the drafters run in; auto: as --dtype. bfloat16 with a float32 target on "
        "a CPU with native bf16 products (avx512_bf16, AMX) halves the drafter's share of a "
        "round; elsewhere it is slower (docs/decoding.md)",
    )


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The parsed `--device` / `--dtype`; a bad value is a one-line error naming the flag."""
    return resolve_flags(str(args.device), str(args.dtype))


def resolve_flags(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`--device` / `--dtype` values (also the demo's settings) -> (device, dtype)."""
    try:
        resolved = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    except (RuntimeError, ValueError) as exc:
        raise DeviceError(f"--device {device!r}: {str(exc).splitlines()[0]}") from None
    try:
        return resolved, resolve_dtype(dtype, resolved)
    except ValueError as exc:
        raise DeviceError(f"--dtype: {exc}") from None


def drafter_dtype(
    spec: str | None, device: torch.device | str, own: str | None = None
) -> torch.dtype | None:
    """The dtype a loaded drafter is cast to, or None to keep the checkpoint's.

    `own` (`--drafter-dtype`) wins where given; else `spec` (`--dtype`) casts the drafter
    too, `auto` only on a GPU. `auto` on the CPU keeps the checkpoint's dtype, so CPU
    evaluation of a bf16 checkpoint (public DFlash drafters) gives the numbers it always gave.
    """
    if own not in (None, "auto"):
        try:
            return resolve_dtype(own, device)
        except ValueError as exc:
            raise DeviceError(f"--drafter-dtype: {exc}") from None
    if spec in (None, "auto") and torch.device(device).type != "cuda":
        return None
    return resolve_dtype(spec, device)
