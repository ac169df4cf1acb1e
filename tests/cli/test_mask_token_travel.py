"""A target without a mask token: named once at `rollout`, used by every later stage.

The target is a small random Llama whose tokenizer names no mask token and has no reserved
one, so every stage that loads it would refuse it without a mask token from somewhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from blockdraft.cli import build_parser
from blockdraft.cli.target_options import TARGET_OPTIONS
from blockdraft.data.rollouts.store import RolloutSet, check_target, read_manifest, write_manifest
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli
from random_targets import save_target_without_mask

MASK = "<gh_stars>"
TRAIN = [
    "optim.max_steps=2",
    "optim.batch_size=4",
    "num_anchors=8",
    "eval.max_rollouts=2",
    "data.max_seq_len=64",
    "drafter.block_size=4",
    "data.eval_split=0.0",
    "device=cpu",
    "logging.progress=false",
]


@pytest.fixture(scope="module")
def maskless(tmp_path_factory) -> Path:
    return save_target_without_mask(tmp_path_factory.mktemp("maskless") / "target")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    texts = ["def add(a, b):", "for i in range(3):", "import os", "class Point:"]
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


def _rollout(capsys, target: Path, prompts: Path, out: Path, *extra: str):
    return run_cli(
        capsys, "rollout", "--target", target, "--prompts", f"{prompts}:prompt", "--out", out,
        "--temperature", "0", "--max-new-tokens", "6", "--no-progress", "--device", "cpu", *extra,
    )  # fmt: skip


def test_without_a_mask_token_the_first_stage_asks_for_one(
    capsys, maskless, prompts_file, tmp_path
):
    code, _, err = _rollout(capsys, maskless, prompts_file, tmp_path / "r")
    assert code == 2
    assert "--mask-token" in one_line_error(err)


def test_the_mask_token_named_at_rollout_travels_through_every_stage(
    capsys, maskless, prompts_file, tmp_path
):
    rollouts, run = tmp_path / "r", tmp_path / "run"
    code, _, err = _rollout(capsys, maskless, prompts_file, rollouts, "--mask-token", MASK)
    assert code == 0, err
    recorded = read_manifest(rollouts)["target"]
    assert recorded["mask_token"] == MASK and recorded["mask_token_id"] == 2

    code, _, err = run_cli(
        capsys, "train", "--config", Path("configs/tiny.yaml").resolve(), f"run_dir={run}",
        f"target.name={maskless}", f"data.train_rollouts={rollouts}", *TRAIN,
    )  # fmt: skip
    assert code == 0, err
    ckpt = json.loads((run / "final" / "config.json").read_text())
    assert ckpt["dflash_config"]["mask_token_id"] == 2

    code, out, err = run_cli(
        capsys, "eval", "--target", maskless, "--rollouts", rollouts, run, "--no-progress",
        "--n-boot", "10", "--device", "cpu", "--cache-dir", tmp_path / "cache",
    )  # fmt: skip
    assert code == 0, err
    assert "MAL" in out

    code, _, err = run_cli(
        capsys, "features", "--target", maskless, "--rollouts", rollouts,
        "--out", tmp_path / "f", "--no-progress", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err

    code, _, err = run_cli(
        capsys, "export", run, "--target", maskless, "--out", tmp_path / "export"
    )
    assert code == 0, err
    served = json.loads((tmp_path / "export" / "config.json").read_text())["dflash_config"]
    assert served["mask_token_id"] == 2 and served["mask_token"] == MASK

    # a resumed rollout takes the recorded token; naming another is refused, naming both
    code, _, err = _rollout(capsys, maskless, prompts_file, rollouts)
    assert code == 0, err
    code, _, err = run_cli(
        capsys, "eval", "--target", maskless, "--rollouts", rollouts, run, "--no-progress",
        "--mask-token", "<|pad|>", "--device", "cpu", "--cache-dir", tmp_path / "cache",
    )  # fmt: skip
    assert code == 2
    line = one_line_error(err)
    assert "'<|pad|>'" in line and f"'{MASK}'" in line and str(rollouts) in line

    code, _, err = run_cli(
        capsys, "train", "--config", Path("configs/tiny.yaml").resolve(),
        f"run_dir={tmp_path / 'run2'}", f"target.name={maskless}",
        f"data.train_rollouts={rollouts}", "target.mask_token=<|pad|>", *TRAIN,
    )  # fmt: skip
    assert code == 2
    line = one_line_error(err)
    assert "target.mask_token" in line and f"'{MASK}'" in line


def test_a_changed_tokenizer_is_named_in_the_mismatch(maskless, prompts_file, tmp_path, capsys):
    rollouts = tmp_path / "r"
    assert _rollout(capsys, maskless, prompts_file, rollouts, "--mask-token", MASK)[0] == 0
    target = load_target(str(maskless), mask_token=MASK)
    target.tokenizer.add_special_tokens({"mask_token": "<|newmask|>"})
    with pytest.raises(ValueError) as exc:
        check_target(RolloutSet.open(rollouts), target)
    message = str(exc.value)
    assert "special tokens added: '<|newmask|>'" in message
    assert "tokenizer hash" in message


def _subcommands(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _subcommands(sub, f"{prefix}{name} ")


def _options(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {s: a.help for a in parser._actions for s in a.option_strings}


def test_every_command_that_loads_a_target_takes_the_same_target_options():
    loads = {}
    for name, sub in _subcommands(build_parser()):
        opts = _options(sub)
        positional = [a.dest for a in sub._actions if not a.option_strings]
        builds_only = name == "target build"  # converts a named target, loads none
        if (
            "--target" in opts
            or (name.startswith("target ") and "name" in positional)
            and not builds_only
        ):
            loads[name] = opts
    assert {"rollout", "rollout-import", "eval", "compare", "suite", "decode", "features",
            "export", "target info", "target sample", "demo"} <= set(loads)  # fmt: skip
    reference = {k: loads["eval"][k] for k in TARGET_OPTIONS}
    for name, opts in loads.items():
        # the demo loads only local targets (named or a directory), in worker processes too:
        # of the target options it takes the mask token
        wanted = ("--mask-token",) if name == "demo" else TARGET_OPTIONS
        assert {k: opts.get(k) for k in wanted} == {k: reference[k] for k in wanted}, name


def test_sets_written_before_the_mask_was_recorded_still_resume(random_target, tmp_path):
    out = make_rollouts(random_target, tmp_path / "r", n=4)
    manifest = read_manifest(out)
    for key in ("mask_token", "mask_token_id", "tokenizer_parts"):
        del manifest["target"][key]
    manifest["complete"] = False
    write_manifest(out, manifest)
    make_rollouts(random_target, out, n=4)  # resumes: no "refusing to mix"
    assert read_manifest(out)["complete"]
