"""A new engine is one class implementing `Engine` plus one registration.

`LoopEngine` below implements the interface with blockdraft's own generation loop (no
serving engine needed): once registered, `rollout --engine loop` writes through it and
`export` prints its serve command and writes its file format (`--format loopfile`),
with no other edit. Its greedy rows must equal the
built-in loop's, so the test fails where a caller bypasses the interface's arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blockdraft.cli import main
from blockdraft.data.rollouts.sampler import generate_batch
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.engines.interface import EngineError, EngineOutput, SpecCounters
from blockdraft.engines.registry import ENGINES, get_engine, register_engine
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE
from blockdraft.targets.registry import load_target


class _Running:
    version = "0.1"

    def __init__(self, model_dir: Any, dtype: str) -> None:
        self.target = load_target(str(model_dir), progress=False)
        self.dtype = dtype

    def generate(self, prompts, settings, stop_token_ids, seeds, *, logprobs=None, topk=0):
        ids = [f"seed-{s}" for s in seeds]
        rows = generate_batch(self.target, [list(p) for p in prompts], ids, settings, topk)
        return [EngineOutput(r.response_ids, r.logprobs, r.topk_ids, r.topk_logprobs) for r in rows]

    def counters(self) -> SpecCounters:
        return SpecCounters()

    def take_drafts(self) -> list:
        return []

    def close(self) -> None:
        self.target = None

    def __enter__(self) -> _Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopFormat:
    """A file format of the planted engine: `check` refuses a lookup-aware export (as the
    config.json the export will have says), `write` adds one file and returns its serve
    command."""

    name = "loopfile"

    def check(self, drafter_cfg, target) -> str:
        if drafter_cfg.get("architectures") == [LOOKUP_ARCHITECTURE]:
            raise EngineError("loop cannot serve this drafter")
        return "checked"

    def write(self, export_dir, checked, dtype, log) -> str:
        (Path(export_dir) / "drafter.loop").write_text(f"{checked} {dtype}")
        return f"loop-serve --file {Path(export_dir) / 'drafter.loop'}"


class LoopEngine:
    name = "loop"
    records_lookup_steps = False
    lookup_rules_match = False
    export_format = LoopFormat()

    def version(self) -> str:
        return _Running.version

    def serve_problem(self, drafter_cfg: dict, target_config: Any) -> str | None:
        return None

    def serve_command(self, target: str, drafter_dir: str, num_proposals: int) -> str:
        return f"loop-serve {target} --drafter {drafter_dir} -k {num_proposals}"

    def load(self, model_dir, *, dtype="float32", **kwargs: Any) -> _Running:
        return _Running(model_dir, dtype)


@pytest.fixture
def loop_engine(monkeypatch):
    monkeypatch.setattr("blockdraft.engines.registry.ENGINES", dict(ENGINES))
    return register_engine(LoopEngine())


def test_a_registered_engine_writes_rollouts_equal_to_the_built_in_loop(
    loop_engine, tmp_path, capsys
):
    common = ["rollout", "--target", "tiny", "--prompts", "stdlib:eval", "--limit", "3",
              "--temperature", "0", "--max-new-tokens", "12", "--no-progress"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "ours")]) == 0
    assert main([*common, "--engine", "loop", "--out", str(tmp_path / "loop")]) == 0
    ours, theirs = RolloutSet.open(tmp_path / "ours"), RolloutSet.open(tmp_path / "loop")
    assert theirs.manifest["engine"] == "loop 0.1"
    assert "engine" not in ours.manifest
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_id == b.prompt_id
        assert a.response_ids.tolist() == b.response_ids.tolist()


def test_export_prints_every_registered_engines_command(loop_engine, tmp_path, capsys):
    from clikit import save_random_drafter

    save_random_drafter(load_target("tiny", progress=False), tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"--drafter {(tmp_path / 'out').resolve()} -k " in printed
    assert "# vllm\nvllm serve " in printed


def test_export_format_of_a_registered_engine_is_checked_first_then_written(
    loop_engine, tmp_path, capsys
):
    from clikit import save_random_drafter

    save_random_drafter(load_target("tiny", progress=False), tmp_path / "ckpt")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out), "--format", "loopfile"]) == 0
    assert (out / "drafter.loop").read_text() == "checked float32"
    assert f"loop-serve --file {out / 'drafter.loop'}" in capsys.readouterr().out
    refused = tmp_path / "refused"  # the same checkpoint, exported with a lookup fallback
    args = ["export", f"hybrid:{tmp_path / 'ckpt'}", "--out", str(refused), "--format", "loopfile"]
    assert main(args) == 2
    assert "error: loop cannot serve this drafter" in capsys.readouterr().err
    assert not refused.exists()  # refused before anything is written


def test_an_unknown_engine_is_one_line_naming_the_registered_ones(loop_engine):
    with pytest.raises(EngineError, match="choose one of vllm, llamacpp, loop"):
        get_engine("sglang")
