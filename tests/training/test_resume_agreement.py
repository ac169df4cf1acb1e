"""Multi-node resume: rank 0 picks the checkpoint and every rank uses it (issue 17).

Nodes without a shared filesystem are simulated with one relative `run_dir` and a
different working directory per rank: each rank sees its own `run/checkpoints`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch.multiprocessing as mp

from blockdraft.training import step_checkpoint as ckpt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(run_dir: Path, step: int) -> None:
    ckpt.write_checkpoint_dir(
        run_dir / "checkpoints" / f"step-{step}",
        lambda p: p.mkdir(parents=True),
        {"x": step},
        ckpt.TrainerProgress(step=step),
        "",
    )


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.chdir(Path(root) / f"node{rank}")
    from blockdraft.training.distributed import init_distributed, shutdown
    from blockdraft.training.trainer import _prepare_run_dir

    ctx = init_distributed("cpu", "gloo", timeout_minutes=1)
    try:
        try:
            out = {"resume_from": str(_prepare_run_dir(Path("run"), ctx, resume=True))}
        except ckpt.RunDirError as exc:
            out = {"error": str(exc)}
    finally:
        shutdown(ctx)
    Path("result.json").write_text(json.dumps(out))


def _run(tmp_path: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"node{r}" / "result.json").read_text()) for r in range(2)]


def test_ranks_resume_from_rank_0s_choice(tmp_path):
    _checkpoint(tmp_path / "node0" / "run", 2)
    _checkpoint(tmp_path / "node1" / "run", 2)
    _checkpoint(tmp_path / "node1" / "run", 4)  # rank 1 alone would resume from step 4
    results = _run(tmp_path)
    assert [r["resume_from"] for r in results] == ["run/checkpoints/step-2"] * 2


def test_a_rank_that_cannot_see_the_checkpoint_stops_every_rank(tmp_path):
    _checkpoint(tmp_path / "node0" / "run", 2)
    (tmp_path / "node1").mkdir()
    results = _run(tmp_path)
    for r in results:
        assert "every rank (every node) must see the same run_dir" in r["error"]


def test_process_group_timeout_is_configurable(monkeypatch):
    import datetime

    import pytest

    import blockdraft.training.distributed as distributed
    from blockdraft.training.config import ConfigError, load_config

    seen = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["data.train_rollouts=unused", "distributed.timeout_minutes=45"])
    distributed.init_distributed("cpu", "gloo", cfg.distributed.timeout_minutes)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=45)}
    assert load_config(None, ["data.train_rollouts=unused"]).distributed.timeout_minutes == 60
    with pytest.raises(ConfigError, match="distributed.timeout_minutes: must be > 0"):
        load_config(None, ["data.train_rollouts=unused", "distributed.timeout_minutes=0"])
