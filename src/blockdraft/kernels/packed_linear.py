"""MKL-packed fp32 weights for the few-row products of speculative decoding on CPU.

Why: `F.linear` on a CPU re-packs the whole weight into MKL's blocked layout on every
call, which at K+1 = 8 rows costs more than the product. Weights are packed once and used
only inside `PackedLinears.active()` (the speculative loop) for 2+-row, no-grad, fp32 CPU
inputs, so the AR baseline, training and features never change. Also packs the screens'
bf16 / int8 weights with oneDNN. Costs: docs/decoding.md.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_BYTES = 4 << 30  # second copy of the weights we are willing to hold
PACK_ROWS = 8  # MKL's packing hint; products of any row count stay correct
# Smaller weights stay on `F.linear`: at 7-8 rows packing loses below ~160k elements and
# wins from ~500k, so `tiny`'s layers stay unpacked
MIN_PACKED_ELEMENTS = 1 << 19


def packing_supported() -> bool:
    """True where this torch build has MKL's packed-GEMM operators."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def _reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """MKL's blocked layout of `weight` (one place, so tests can make it fail)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


def tensor_version(weight: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors (they have none, and only
    inference-mode code, i.e. never a training step, can change them)."""
    return None if weight.is_inference() else weight._version


class PackedWeight:
    """One fp32 `[out, in]` weight packed once; `__call__(x)` is `F.linear(x, weight, bias)`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.version = tensor_version(self.weight)
        self.packed = _reorder(self.weight, PACK_ROWS)

    def __deepcopy__(self, memo: dict) -> None:
        """Copies of a packed model get no pack (MKL's packed tensor cannot be copied, and
        the copy's weights are its own): their linears run `F.linear`."""
        return None

    def __reduce__(self) -> tuple:
        return (_no_pack, ())  # pickled models likewise come back unpacked

    def usable(self, x: torch.Tensor) -> bool:
        """Whether `x` may take the packed product (see the module doc for why these)."""
        return (
            x.dim() >= 2
            and x.numel() > x.shape[-1]  # 2+ rows
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
            and tensor_version(self.weight) == self.version
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.usable(x):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, self.packed, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A `PackedWeight` for an fp32 CPU weight where the build supports it, else None."""
    if (
        not packing_supported()
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.numel() < MIN_PACKED_ELEMENTS
    ):
        return None
    try:
        return PackedWeight(weight)
    except RuntimeError:  # MKL refusing the weight: the caller keeps F.linear
        return None


def pack_bf16_onednn(low: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed layout of a bf16 `[out, in]` weight for `onednn_linear`, or None
    where the build or the device lacks it (callers then use `F.linear`)."""
    if low.device.type != "cpu":
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(low, PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` (no bias) with a weight packed by `pack_bf16_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


INT8_ROWS = 16  # oneDNN's packing hint for the int8 screen (2 passes x K+1 = 8 rows)


def pack_int8_onednn(quantised: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed layout of a symmetric int8 `[out, in]` weight for
    `onednn_int8_linear`, or None where the build lacks the x86 quantised operators."""
    if quantised.device.type != "cpu" or quantised.dtype != torch.int8:
        return None
    try:
        return torch.ops.onednn.qlinear_prepack(quantised, [INT8_ROWS, quantised.shape[1]])
    except (AttributeError, RuntimeError):
        return None


def onednn_int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `((x - 128) @ Wq.T) * scales` for uint8 `x` (zero point 128) and the per-row
    `scales` of a weight packed by `pack_int8_onednn`: int32 accumulation, one rounding."""
    zero_points = torch.zeros(scales.shape[0], dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 128, packed, scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


@functools.cache
def int8_products_exact() -> bool:
    """Whether `onednn_int8_linear` is exact integer arithmetic here (checked once).

    Why: CPUs without VNNI saturate u8 x s8 int16 pairs, and a zero point applied in fp32
    loses integers above 2^24; either breaks the int8 screen's bound. The probe rows hit
    both (all-extreme inputs, huge cancelling sums) plus random ones."""
    hidden = 2048
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (8, hidden), generator=g, dtype=torch.int8)
    weight[0], weight[1] = 127, -127
    x = torch.randint(0, 256, (4, hidden), generator=g, dtype=torch.uint8)
    x[0] = 255
    x[1] = 1
    x[1, : hidden // 2 + 1] = 255  # sum of +-127 x 127 terms: 2 x 127^2 from ~2^25
    scales = torch.rand(8, generator=g) + 0.5
    packed = pack_int8_onednn(weight)
    if packed is None:
        return False
    try:
        got = onednn_int8_linear(x, packed, scales).double()
    except RuntimeError:
        return False
    exact = ((x.double() - 128) @ weight.double().T) * scales.double()
    return bool(((got - exact).abs() <= 2 * 2.0**-24 * exact.abs() + 1e-30).all())


class PackedLinears:
    """Packed copies of a model's fp32 `nn.Linear` weights, used while `active()`.

    Each packed module's `forward` is bound to `_packed_forward`, which takes the packed
    product only while the owner is active and the pack is still of the module's own
    weight (same storage and version): a deep copy computes with its own weights, and a
    pickled model loads unpacked."""

    def __init__(self, model: nn.Module) -> None:
        self.token = next(_TOKENS)
        self.count = 0
        for module in _packable(model):
            module._blockdraft_pack = PackedWeight(module.weight, module.bias)
            module._blockdraft_owner = self.token
            module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
            self.count += 1

    @classmethod
    def of(cls, model: nn.Module) -> PackedLinears | None:
        """The (cached) packing of `model`, or None where it cannot apply (module doc)."""
        if model in _PACKED:
            return _PACKED[model]
        packable = [m.weight for m in _packable(model)]
        size = sum(w.numel() * w.element_size() for w in packable)
        ok = (
            packing_supported()
            and packable
            and all(w.device.type == "cpu" for w in packable)
            and size <= MAX_PACKED_BYTES
        )
        packs = None
        if ok:
            try:
                packs = cls(model)
            except RuntimeError:  # MKL refusing a weight: plain products, never a failure
                packs = None  # (modules wrapped so far belong to an owner never active)
        _PACKED[model] = packs
        return packs

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Route 2+-row no-grad fp32 products through the packed weights inside the block."""
        _ACTIVE[self.token] = _ACTIVE.get(self.token, 0) + 1
        try:
            yield
        finally:
            _ACTIVE[self.token] -= 1
            if not _ACTIVE[self.token]:
                del _ACTIVE[self.token]


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`forward` of a packed `nn.Linear` (see `PackedLinears`)."""
    pack = self._blockdraft_pack
    if (
        pack is not None
        and self._blockdraft_owner in _ACTIVE
        and pack.weight.data_ptr() == self.weight.data_ptr()
        and pack.usable(x)
    ):
        return pack(x)
    return F.linear(x, self.weight, self.bias)


# pickle stores a bound method as getattr(obj, __name__): "forward" unpickles to the
# module's own (plain) forward
_packed_forward.__name__ = "forward"


def _no_pack() -> None:
    return None


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ACTIVE: dict[int, int] = {}  # owner token -> nesting depth of active() blocks
_TOKENS = itertools.count()


def _packable(model: nn.Module) -> list[nn.Linear]:
    """The model's plain fp32 linears large enough to gain from packing (subclasses with
    their own forward are left alone)."""
    return [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and m.weight.dtype == torch.float32
        and m.weight.numel() >= MIN_PACKED_ELEMENTS
    ]


@contextlib.contextmanager
def packed_linears(*models: nn.Module | None) -> Iterator[tuple[bool, ...]]:
    """Activate packing for every given model that supports it; yields, per model, whether
    its linears are packed (None entries and unsupported models: False)."""
    with contextlib.ExitStack() as stack:
        flags = []
        for model in models:
            packs = PackedLinears.of(model) if isinstance(model, nn.Module) else None
            if packs is not None:
                stack.enter_context(packs.active())
            flags.append(packs is not None)
        yield tuple(flags)
