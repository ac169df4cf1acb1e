"""Rollouts from several processes: planning, part files, torchrun == one process, kill -9."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockdraft.data.rollouts import RolloutSet, SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.distributed import (
    extend_prefix,
    finished_beyond_prefix,
    plan_tasks,
    record_part,
)
from blockdraft.data.rollouts.store import RolloutError

HERE = Path(__file__).parent
CHILD = HERE / "distributed_rollout_child.py"


def _entry(first: int, rows: int, name: str | None = None) -> dict:
    return {
        "file": name or f"shard-x{first}.safetensors",
        "first_row": first,
        "rows": rows,
        "response_tokens": 10 * rows,
    }


def _manifest(shards: list[dict]) -> dict:
    return {
        "shards": list(shards),
        "num_rollouts": sum(s["rows"] for s in shards),
        "num_response_tokens": sum(s["response_tokens"] for s in shards),
    }


def test_plan_skips_finished_shards_and_keeps_the_one_process_grid():
    m = _manifest([_entry(0, 3, "shard-00000.safetensors")])
    fresh = plan_tasks(m, {}, 10, 3)
    assert [(t.file, t.first_row, t.rows) for t in fresh] == [
        ("shard-00001.safetensors", 3, 3),
        ("shard-00002.safetensors", 6, 3),
        ("shard-00003.safetensors", 9, 1),
    ]
    pool = {6: _entry(6, 3, "shard-00002.safetensors")}
    assert [(t.file, t.first_row, t.rows) for t in plan_tasks(m, pool, 10, 3)] == [
        ("shard-00001.safetensors", 3, 3),
        ("shard-00003.safetensors", 9, 1),
    ]
    # a recorded shard from a run with another shard size: the grid bends around it
    odd = {5: _entry(5, 2, "shard-00002.safetensors")}
    tasks = plan_tasks(m, odd, 10, 3)
    assert [(t.first_row, t.rows) for t in tasks] == [(3, 2), (7, 3)]
    assert len({t.file for t in tasks} | {"shard-00002.safetensors"}) == 3  # no name reused
    covered = sorted([(t.first_row, t.rows) for t in tasks] + [(5, 2), (0, 3)])
    assert [a for a, _ in covered] == [0, 3, 5, 7] and sum(r for _, r in covered) == 10
    assert plan_tasks(_manifest([_entry(0, 12)]), {}, 10, 3) == []  # stored set is longer


def test_part_files_extend_the_prefix_in_order(tmp_path):
    m = _manifest([_entry(0, 2)])
    record_part(tmp_path, 1, _entry(4, 2))
    record_part(tmp_path, 1, _entry(6, 1))
    record_part(tmp_path, 3, _entry(0, 2))  # already listed: ignored
    pool = finished_beyond_prefix(tmp_path, m)
    assert sorted(pool) == [4, 6]
    assert not extend_prefix(m, pool) and m["num_rollouts"] == 2  # rows 2..3 missing
    pool[2] = _entry(2, 2)
    assert extend_prefix(m, pool) and m["num_rollouts"] == 7 and pool == {}
    assert [s["first_row"] for s in m["shards"]] == [0, 2, 4, 6]
    assert m["num_response_tokens"] == 70
    (tmp_path / "manifest.rank-00002.json").write_text('{"shards": [}')
    with pytest.raises(RolloutError, match=r"manifest.rank-00002.json:1: invalid JSON"):
        finished_beyond_prefix(tmp_path, m)
    (tmp_path / "manifest.rank-00002.json").write_text('{"rank": 2}')
    with pytest.raises(RolloutError, match=r"manifest.rank-00002.json: not a rollout part file"):
        finished_beyond_prefix(tmp_path, m)


def _child():
    spec = importlib.util.spec_from_file_location("distributed_rollout_child", CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torchrun(out: Path, marker: Path, pause_rank: int, pause_after: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(CHILD),
            str(out),
            str(marker),
            str(pause_rank),
            str(pause_after),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def _finished_files(out: Path) -> dict[str, bytes]:
    """Bytes of every shard the directory lists (manifest prefix and part files)."""
    names = [s["file"] for s in json.loads((out / "manifest.json").read_text())["shards"]]
    for part in out.glob("manifest.rank-*.json"):
        names += [s["file"] for s in json.loads(part.read_text())["shards"]]
    return {n: (out / n).read_bytes() for n in names}


def _assert_same_rows(a: RolloutSet, b: RolloutSet) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert ra.prompt_id == rb.prompt_id
        for field in ("prompt_ids", "response_ids", "logprobs", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(ra, field), getattr(rb, field)), (ra.prompt_id, field)


def test_torchrun_two_ranks_kill9_then_resume_equals_one_process(random_target, tmp_path):
    child = _child()
    out, marker = tmp_path / "dist", tmp_path / "paused"
    proc = _torchrun(out, marker, pause_rank=1, pause_after=1)
    deadline = time.time() + 240
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"rank 1 did not reach the pause point:\n{proc.stdout.read().decode()}")
        time.sleep(0.2)
    time.sleep(1.0)  # let rank 0 finish a shard or two meanwhile
    os.kill(int(marker.read_text()), signal.SIGKILL)  # kill -9 one rank
    try:
        proc.wait(timeout=120)  # torchrun stops the surviving rank and exits
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun did not exit after a rank was killed")
    assert proc.returncode != 0
    killed = json.loads((out / "manifest.json").read_text())
    assert not killed["complete"]
    finished = _finished_files(out)
    assert any(n in finished for n in ("shard-00001.safetensors",))  # rank 1's first shard
    one_proc_resume = tmp_path / "resumed-by-one-process"
    shutil.copytree(out, one_proc_resume)

    marker.unlink()
    proc = _torchrun(out, marker, pause_rank=-1, pause_after=0)
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log

    kwargs = dict(
        batch_size=child.BATCH_SIZE,
        shard_size=child.SHARD_SIZE,
        store_topk=child.STORE_TOPK,
        progress=False,
    )
    settings = SamplingSettings(**child.SETTINGS)
    fresh = generate_rollouts(
        random_target, child.make_prompts(), tmp_path / "one", settings, **kwargs
    )
    single = generate_rollouts(
        random_target, child.make_prompts(), one_proc_resume, settings, **kwargs
    )

    for directory in (out, one_proc_resume):
        rs = RolloutSet.open(directory)
        m = rs.manifest
        assert m["complete"] and m["num_rollouts"] == child.NUM_PROMPTS
        assert [s["first_row"] for s in m["shards"]] == list(range(0, child.NUM_PROMPTS, 2))
        assert [r.prompt_id for r in rs] == [p.id for p in child.make_prompts()]  # no dup/loss
        assert not list(directory.glob("manifest.rank-*.json"))
        assert not list(directory.glob(".*.tmp"))
        _assert_same_rows(rs, fresh)
        rs.verify()
    assert {n: (out / n).read_bytes() for n in finished} == finished  # untouched by the resume
    assert len(single) == child.NUM_PROMPTS
