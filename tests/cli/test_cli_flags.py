"""One dialect across the CLI: shipped recipes by name, `--version`, "did you mean" for a
mistyped command or flag, dotted overrides anywhere, the same flag meaning the same thing
in every command, and `train --resume` refusing a run directory that is not there."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest
import yaml

import blockdraft.cli.features as features_cli
from blockdraft.cli import build_parser
from blockdraft.evaluation.suite import load_suite
from blockdraft.recipes import SUITE, TRAIN, recipe_dir, recipe_names, resolve_recipe
from blockdraft.serialization.drafter_spec import DrafterSpec
from clikit import make_rollouts, one_line_error, run_cli

REPO = Path(__file__).resolve().parents[2]


def cli(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr), also for errors argparse raises while parsing."""
    try:
        return run_cli(capsys, *argv)
    except SystemExit as exc:
        out = capsys.readouterr()
        return int(exc.code or 0), out.out, out.err


# --- shipped recipes -------------------------------------------------------------------


def test_every_recipe_of_the_repository_is_shipped_package_data():
    """The package's recipe folders hold the repository's `configs/`, and pyproject.toml's
    package data covers every file, so a wheel carries them too."""
    for kind, folder in ((TRAIN, REPO / "configs"), (SUITE, REPO / "configs" / "suites")):
        names = sorted(p.stem for p in folder.glob("*.yaml"))
        assert names and recipe_names(kind) == names
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["blockdraft"]
    pkg = REPO / "src" / "blockdraft"
    for path in (pkg / "configs").rglob("*.yaml"):
        rel = path.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data"


@pytest.mark.parametrize("spec", ["dflash-qwen3-8b", "dflash-qwen3-8b.yaml"])
def test_train_config_by_name(spec, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here: the shipped recipe is found
    code, out, _ = cli(capsys, "train", "--config", spec, "--print-config")
    assert code == 0
    shipped = yaml.safe_load((REPO / "configs" / "dflash-qwen3-8b.yaml").read_text())
    printed = yaml.safe_load(out)
    assert printed["run_dir"] == shipped["run_dir"]
    assert printed["drafter"]["num_layers"] == shipped["drafter"]["num_layers"] == 5


def test_an_existing_path_wins_over_a_shipped_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny").write_text("run_dir: runs/mine\ndata: {train_rollouts: R}\n")
    code, out, _ = cli(capsys, "train", "--config", "tiny", "--print-config")
    assert code == 0 and yaml.safe_load(out)["run_dir"] == "runs/mine"
    # the checkout's own path, typed outside the checkout, is the shipped recipe
    assert resolve_recipe("configs/tiny.yaml") == recipe_dir(TRAIN) / "tiny.yaml"


def test_an_unknown_recipe_is_one_line_naming_the_shipped_ones(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "train", "--config", "dflash-qwen3-9b", "--print-config")
    line = one_line_error(err)
    assert code == 2 and "--config dflash-qwen3-9b" in line
    assert "dflash-qwen3-8b" in line and "tiny-edr-finetune" in line
    code, _, err = cli(capsys, "suite", "--target", "tiny", "--suite", "smollm", "ngram")
    line = one_line_error(err)
    assert code == 2 and "--suite smollm" in line and "smollm2" in line


def test_list_configs_and_list_suites(capsys):
    code, out, _ = cli(capsys, "train", "--list-configs")
    assert code == 0
    assert [ln.split()[0] for ln in out.splitlines()] == recipe_names(TRAIN)
    code, out, _ = cli(capsys, "suite", "--list-suites")  # no --target needed
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()] == recipe_names(SUITE)


def test_a_shipped_suite_by_name_is_the_repository_file(tmp_path, monkeypatch):
    """Also its `data_dir`, which resolves relative to the file (through the link)."""
    by_path = load_suite(REPO / "configs" / "suites" / "smollm2.yaml")
    monkeypatch.chdir(tmp_path)
    by_name = load_suite(resolve_recipe("smollm2", SUITE, "--suite"))
    assert by_name == by_path and by_name.name == "smollm2"
    assert resolve_recipe("smollm2.yaml", SUITE) == recipe_dir(SUITE) / "smollm2.yaml"


# --- --version and "did you mean" ------------------------------------------------------


def test_version(capsys):
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip().startswith("blockdraft ") and out.strip() != "blockdraft"


@pytest.mark.parametrize(
    ("argv", "guess", "help_of"),
    [
        (["evall"], "'eval'", "blockdraft eval --help"),
        (["eval", "--jsn", "x.json"], "'--json'", "blockdraft eval --help"),
        (["eval", "--targt", "tiny"], "'--target'", "blockdraft eval --help"),
        (["target", "bild", "tiny"], "'build'", "blockdraft target build --help"),
        (["export", "ckpt", "--dtype", "bf16"], "'bfloat16'", "blockdraft export --help"),
        (["train", "--config", "tiny", "--resme"], "'--resume'", "blockdraft train --help"),
    ],
)
def test_did_you_mean(argv, guess, help_of, capsys):
    code, _, err = cli(capsys, *argv)
    line = one_line_error(err)
    assert code == 2 and f"did you mean {guess}?" in line and f"`{help_of}`" in line, line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # a mistyped command is named before its flags are judged by the top-level parser
        (["evaluate", "--target", "tiny"], "unknown command 'evaluate': did you mean 'eval'?"),
        # eval scores rollouts: their settings are fixed, so no "did you mean --target"
        (
            ["eval", "--temprature", "0.5", "--target", "tiny", "--rollouts", "r", "ngram"],
            "eval has no sampling flags: the rollouts carry their temperature",
        ),
        # serve-check takes its drafter positionally (decode keeps --drafter too)
        (["serve-check", "--drafter", "run", "--target", "tiny"], "takes DRAFTER as a positional"),
    ],
)
def test_misleading_guesses_are_replaced_by_what_is_meant(argv, says, capsys):
    code, _, err = cli(capsys, *argv)
    line = one_line_error(err)
    assert code == 2 and says in line, line
    assert "--drafter-dtype" not in line and "'--target'" not in line


@pytest.mark.parametrize(
    "argv",
    [
        ["serve-check", "run", "--target", "tiny", "--rollouts", "r", "--drafter", "bfloat16"],
        ["eval", "--target", "tiny", "--rollouts", "r", "--drafter", "float32", "ngram"],
        ["train", "--config", "tiny", "--print", "--threads", "1"],
        ["decode", "ngram", "--target", "tiny", "--prompts", "stdlib:eval", "--temp", "0"],
    ],
)
def test_no_flag_is_taken_for_a_prefix_of_another(argv, capsys):
    """argparse's prefix matching is off (`allow_abbrev=False`): `--drafter` is never
    read as `--drafter-dtype`, and a shortened flag gets its full name suggested."""
    for parser in _all_parsers(build_parser()):
        assert parser.allow_abbrev is False, parser.prog
    code, _, err = cli(capsys, *argv)
    flag = next(
        a
        for a in argv[1:]
        if a.startswith("--")
        and a not in ("--target", "--rollouts", "--config", "--threads", "--prompts")
    )
    assert code == 2 and f"unrecognized argument {flag}" in one_line_error(err)


def _all_parsers(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_no_guess_for_a_word_like_no_command(capsys):
    code, _, err = cli(capsys, "zzzz")
    line = one_line_error(err)
    assert code == 2 and "did you mean" not in line and "eval" in line


# --- dotted overrides anywhere ---------------------------------------------------------


def test_overrides_after_a_flag(capsys, tmp_path):
    code, out, err = cli(
        capsys, "train", "--config", "tiny", "data.train_rollouts=R", "optim.max_steps=1",
        f"run_dir={tmp_path / 'D'}", "--print-config", "logging.progress=false",
        "--threads", "1", "optim.lr=0.5",
    )  # fmt: skip
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["logging"]["progress"] is False and cfg["optim"]["lr"] == 0.5
    assert cfg["optim"]["max_steps"] == 1 and cfg["data"]["train_rollouts"] == "R"


def test_a_stray_word_is_still_refused(capsys):
    code, _, err = cli(capsys, "train", "--config", "tiny", "--print-config", "a=1", "stray")
    assert code == 2 and "stray" in one_line_error(err)


# --- train --resume --------------------------------------------------------------------


def test_resume_of_a_missing_run_dir_is_refused(capsys, tmp_path):
    run_dir = tmp_path / "nope"
    code, _, err = cli(capsys, "train", "--config", "tiny", f"run_dir={run_dir}", "--resume")
    line = one_line_error(err)
    assert code == 2 and f"no run directory {run_dir}" in line and "drop --resume" in line
    assert not run_dir.exists()
    # a run_dir without a checkpoint yet passes this check (and fails later, on its data)
    run_dir.mkdir()
    code, _, err = cli(
        capsys, "train", "--config", "tiny", f"run_dir={run_dir}", "--resume",
        f"data.train_rollouts={tmp_path / 'missing'}",
    )  # fmt: skip
    assert code == 2 and "run directory" not in one_line_error(err)


# --- the same flag, the same meaning ---------------------------------------------------


def test_decode_takes_its_drafter_positionally_or_as_drafter(capsys):
    parser = build_parser()
    common = ["decode", "--target", "t", "--prompts", "p.jsonl"]
    assert parser.parse_args([*common, "ngram"]).drafter == DrafterSpec("ngram")
    assert parser.parse_args([*common, "--drafter", "ngram"]).drafter_flag == DrafterSpec("ngram")
    for extra in ([], ["a", "--drafter", "b"]):
        code, _, err = cli(capsys, *common, *extra)
        assert code == 2 and "decode takes one drafter" in one_line_error(err)


def test_sampling_defaults_are_in_the_help():
    helps = {
        p.prog: {o: a.help for a in p._actions for o in a.option_strings}
        for p in build_parser()._actions[-1].choices.values()
    }
    assert "default 1.0" in helps["blockdraft rollout"]["--temperature"]
    assert "default 0" in helps["blockdraft decode"]["--temperature"]


def test_demo_dtype_has_choices(capsys):
    action = next(
        a
        for a in build_parser()._actions[-1].choices["demo"]._actions
        if "--dtype" in a.option_strings
    )
    assert list(action.choices) == ["auto", "float32", "bfloat16", "float16"]


@pytest.fixture
def features_run(random_target, tmp_path, monkeypatch):
    """`blockdraft features` on a small rollout set, recording the target's dtype."""
    rollouts = make_rollouts(random_target, tmp_path / "r", n=2, tokens=4)
    loaded = {}

    def load(name, **kw):
        loaded["dtype"] = kw["dtype"]
        return random_target

    monkeypatch.setattr(features_cli, "load_target", load)
    base = ["features", "--target", "t", "--rollouts", rollouts, "--no-progress"]

    def run(capsys, out: str, *flags: str):
        code, _, err = cli(capsys, *base, "--out", tmp_path / out, *flags)
        assert code == 0, err
        stored = json.loads((tmp_path / out / "manifest.json").read_text())["dtype"]
        return str(loaded["dtype"]).removeprefix("torch."), stored, err

    return run


def test_features_dtype_is_the_targets_and_store_dtype_the_stored_one(features_run, capsys):
    assert features_run(capsys, "a")[:2] == ("float32", "bfloat16")  # defaults on a CPU
    assert features_run(capsys, "b", "--store-dtype", "float32")[:2] == ("float32", "float32")
    target, stored, err = features_run(capsys, "c", "--dtype", "float16")
    assert (target, stored) == ("float16", "bfloat16")
    # `--dtype` once named the stored dtype: an explicit one says what it means now
    assert "note: features --dtype is the target's dtype" in err and "--store-dtype" in err
    target, stored, err = features_run(capsys, "d", "--target-dtype", "float16")
    assert (target, stored) == ("float16", "bfloat16") and "note:" not in err
