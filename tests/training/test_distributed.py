"""Data parallel: 2 gloo processes give the same drafter as 1 process on the same global batch."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from trainkit import ddp_worker, make_config

from blockdraft.training import train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_equals_one_process(target, rollout_dirs, tmp_path):
    # D-PACE: its normalisation (summed weights over the batch) is batch-global, the case
    # where naive per-rank averaging would differ from one process.
    sections = dict(
        objective={"name": "dpace"},
        optim={"max_steps": 4, "batch_size": 8},
        eval={"at_start": False},
        data={"eval_split": 0.0, "train_rollouts": str(rollout_dirs["greedy"]), "max_seq_len": 64},
    )
    single = make_config(
        tmp_path / "single",
        rollout_dirs,
        "greedy",
        **sections,
        **{"logging": {"every": 1, "progress": False, "tensorboard": False}},
    )
    single.optim.grad_accum = (
        2  # 1 process x 2 micro-batches of 4 == 2 processes x 1 micro-batch of 4
    )
    one = train(single, target=target)

    multi = make_config(tmp_path / "multi", rollout_dirs, "greedy", **sections)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=ddp_worker, args=(r, 2, port, multi.to_dict())) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]

    a = load_file(str(one / "model.safetensors"))
    b = load_file(str(tmp_path / "multi" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
