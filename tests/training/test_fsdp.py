"""FSDP2: 2 gloo processes with sharded parameters train the same drafter as 1 process.

One spawn of 2 ranks runs three trainings on a process group the worker owns (so
`train` neither creates nor destroys it and the group survives the simulated crash):
an uninterrupted FSDP run with evaluation and step checkpoints, then the same run
crashed after its first checkpoint, then its `--resume`. The 1-process reference runs
in the test process with 2 micro-batches, i.e. the same global batch split the same way.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from trainkit import learnable_target, make_config, read_metrics

from blockdraft.training import config_from_dict, train
from blockdraft.training.step_checkpoint import read_trainer_tensors


class SimulatedCrash(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_worker(rank: int, world_size: int, port: int, straight: dict, crashed: dict) -> None:
    """One rank: straight FSDP run, then a run crashed at step 4 and resumed from step-2."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    import blockdraft.training.loop as loop

    dist.init_process_group("gloo")
    try:
        target = learnable_target()
        train(config_from_dict(straight), target=target)
        real_step = loop.train_step

        def crashing_step(parts, step, want_acc):
            if step == 3:  # after the step-2 checkpoint; every rank stops at the same point
                raise SimulatedCrash
            return real_step(parts, step, want_acc)

        loop.train_step = crashing_step
        with pytest.raises(SimulatedCrash):
            train(config_from_dict(crashed), target=target)
        loop.train_step = real_step
        train(config_from_dict(crashed), target=target, resume=True)
        dist.barrier()  # both ranks done before either tears gloo down (else: abort at exit)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_equals_one_process_and_resumes_exactly(target, rollout_dirs, tmp_path):
    sections = dict(
        objective={"name": "dpace"},  # batch-global normalisation: naive averaging would differ
        optim={"max_steps": 4, "batch_size": 8},
        eval={"at_start": False, "every": 2, "max_rollouts": 4},
        checkpoint={"save_every": 2, "keep_last": 2},
        data={"train_rollouts": str(rollout_dirs["greedy"]), "max_seq_len": 64},
        logging={"every": 1},
    )
    multi = {
        name: make_config(
            tmp_path / name, rollout_dirs, "greedy", distributed={"strategy": "fsdp"}, **sections
        ).to_dict()
        for name in ("straight", "crashed")
    }
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=fsdp_worker, args=(r, 2, port, multi["straight"], multi["crashed"]))
        for r in range(2)
    ]
    for p in procs:
        p.start()

    single = make_config(tmp_path / "single", rollout_dirs, "greedy", **sections)
    single.optim.grad_accum = 2  # 1 process x 2 micro-batches of 4 == 2 ranks x 1 of 4
    one = train(single, target=target)  # meanwhile, while the ranks start up

    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]

    a = load_file(str(one / "model.safetensors"))
    b = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)

    # the checkpoint layout does not depend on the strategy: same optimizer state ids
    oa = read_trainer_tensors(one)["optimizer"]
    ob = read_trainer_tensors(tmp_path / "straight" / "final")["optimizer"]
    assert oa["state"].keys() == ob["state"].keys()
    assert oa["param_groups"] == ob["param_groups"]
    for i in oa["state"]:
        assert oa["state"][i].keys() == ob["state"][i].keys()
        torch.testing.assert_close(
            oa["state"][i]["exp_avg"], ob["state"][i]["exp_avg"], rtol=1e-3, atol=1e-6
        )

    # held-out evaluation ran on the gathered full weights
    ev_a = [m["eval_mal"] for m in read_metrics(tmp_path / "single") if m["event"] == "eval"]
    ev_b = [m["eval_mal"] for m in read_metrics(tmp_path / "straight") if m["event"] == "eval"]
    assert len(ev_b) == 2 and ev_b == pytest.approx(ev_a, abs=1e-4)

    c = load_file(str(tmp_path / "crashed" / "final" / "model.safetensors"))
    for k in b:
        assert torch.equal(b[k], c[k]), k
    steps = [m["step"] for m in read_metrics(tmp_path / "crashed") if m["event"] == "train"]
    assert steps == [1, 2, 3, 4]
