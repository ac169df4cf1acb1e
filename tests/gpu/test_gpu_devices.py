"""No large tensor is made off the device: the guard itself, rollouts and the decode loop.

(The training steps run under the same guard in test_gpu_steps.py.)"""

from __future__ import annotations

import torch
from device_guard import OffDeviceTensors

from blockdraft.data.rollouts.sampler import SamplingSettings, generate_batch
from blockdraft.decoding.loop import decode
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from random_targets import make_random_target


def test_the_guard_catches_a_tensor_made_off_the_device(device):
    other = "meta" if device.type == "cpu" else "cpu"
    with OffDeviceTensors(device) as guard:
        x = torch.randn(300, 300, device=device)
        (x @ x).sum()
        torch.zeros(300, 300, device=device).cpu()  # an explicit copy is allowed
    assert not guard.found
    with OffDeviceTensors(device) as guard:
        torch.ones(300, 300, device=other) * 2  # e.g. a factory call without device=
    assert guard.found and all(other in f for f in guard.found), guard.found


def _target_and_drafter(device):  # type: ignore[no-untyped-def]
    target = make_random_target("llama", seed=1)
    target.model.to(device)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=8)
    torch.manual_seed(0)
    drafter = BlockDrafter(cfg).bind_target(target).to(device).eval()
    return target, drafter


def test_rollouts_and_decoding_stay_on_the_device(device):
    target, drafter = _target_and_drafter(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 12, 8)]
    with OffDeviceTensors(device, max_host_elements=256) as guard:
        generate_batch(target, prompts, ["a", "b", "c"], SamplingSettings(1.0, max_new_tokens=12))
        for temperature in (0.0, 1.0):
            for verifier in ("standard", "block"):
                decode(
                    target,
                    drafter,
                    prompts,
                    temperature=temperature,
                    max_new_tokens=12,
                    verifier=verifier,
                    measure_ar=False,
                )
    assert not guard.found, guard.found
