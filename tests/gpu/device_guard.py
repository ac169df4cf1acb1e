"""A guard that fails when code meant for one device makes large tensors on another.

Why: on a GPU, a tensor created without `device=` lands on the CPU; if it is small it is
silently copied each step (a host sync), if it is large the work runs on the CPU at a
hundredth of the speed, and neither raises. `OffDeviceTensors` sees every op (a
`TorchDispatchMode`: forward, backward and optimizer alike) and records each output
tensor of more than `max_host_elements` elements that lives on another device than the
one under test. Explicit copies (`.to`, `.cpu()`, `copy_`) are allowed: moving results
to the host on purpose is not the bug this catches.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::to", "aten::_copy_from"}


class OffDeviceTensors(TorchDispatchMode):
    """`with OffDeviceTensors(device) as guard: ...; assert not guard.found, guard.found`."""

    def __init__(self, device: torch.device, max_host_elements: int = 1 << 16) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.max_host_elements = max_host_elements
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in TRANSFERS:
            return out
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.device.type != self.device.type
                and t.numel() > self.max_host_elements
            ):
                self.found.append(f"{name} -> {tuple(t.shape)} on {t.device}")
        return out
