"""Every numeric flag of every sub-command and every numeric train key is checked, by name,
before anything runs (issue 29): one `error:` line naming the flag or key, exit status 2,
no traceback, no file written."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from blockdraft.training.config import ConfigError, load_config
from clikit import one_line_error, run_cli

REPO = Path(__file__).resolve().parents[2]

ROLLOUT = ["rollout", "--target", "m", "--prompts", "p.jsonl", "--out", "out"]
IMPORT = ["rollout-import", "r.jsonl", "--target", "m", "--out", "out"]
FEATURES = ["features", "--target", "m", "--rollouts", "r", "--out", "out"]
EVAL = ["eval", "--target", "m", "--rollouts", "r", "ngram"]
COMPARE = ["compare", "--target", "m", "--rollouts", "r", "ngram", "ngram:k=3"]
DECODE = ["decode", "--target", "m", "--drafter", "ngram", "--prompts", "p.jsonl"]
SAMPLE = ["target", "sample", "m"]
SUITE = ["suite", "--target", "m", "--benchmark", "a=p.jsonl", "ngram"]

# (command line, bad flag and value, the flag the one-line error must name)
BAD_FLAGS = [
    (ROLLOUT, ["--batch-size", "0"], "--batch-size"),
    (ROLLOUT, ["--shard-size", "0"], "--shard-size"),
    (ROLLOUT, ["--store-topk", "-1"], "--store-topk"),
    (ROLLOUT, ["--temperature", "-1"], "--temperature"),
    (ROLLOUT, ["--temperature", "nan"], "--temperature"),
    (ROLLOUT, ["--top-p", "0"], "--top-p"),
    (ROLLOUT, ["--top-p", "1.5"], "--top-p"),
    (ROLLOUT, ["--top-k", "-1"], "--top-k"),
    (ROLLOUT, ["--max-new-tokens", "0"], "--max-new-tokens"),
    (ROLLOUT, ["--seed", "-1"], "--seed"),
    (ROLLOUT, ["--limit", "0"], "--limit"),
    (ROLLOUT, ["--batch-size", "two"], "--batch-size"),
    (IMPORT, ["--batch-tokens", "0"], "--batch-tokens"),
    (IMPORT, ["--shard-size", "0"], "--shard-size"),
    (IMPORT, ["--store-topk", "-1"], "--store-topk"),
    (IMPORT, ["--top-k", "-2"], "--top-k"),
    (IMPORT, ["--top-p", "2"], "--top-p"),
    (IMPORT, ["--temperature", "-0.5"], "--temperature"),
    (IMPORT, ["--max-new-tokens", "0"], "--max-new-tokens"),
    (IMPORT, ["--limit", "0"], "--limit"),
    (FEATURES, ["--batch-size", "0"], "--batch-size"),
    (FEATURES, ["--shard-size", "0"], "--shard-size"),
    (FEATURES, ["--max-gb", "0"], "--max-gb"),
    (FEATURES, ["--max-seq-len", "1"], "--max-seq-len"),
    (FEATURES, ["--layer-ids", "-1"], "--layer-ids"),
    (["train"], ["--plan", "--nproc", "0"], "--nproc"),
    (["train"], ["--plan", "--device-gb", "-1"], "--device-gb"),
    (EVAL, ["--n-boot", "0"], "--n-boot"),
    (EVAL, ["--seed", "-1"], "--seed"),
    (COMPARE, ["--n-boot", "0"], "--n-boot"),
    (SUITE, ["--limit", "0"], "--limit"),
    (SUITE, ["--n-boot", "0"], "--n-boot"),
    (SUITE, ["--seed", "-1"], "--seed"),
    (DECODE, ["--temperature", "-1"], "--temperature"),
    (DECODE, ["--top-p", "0"], "--top-p"),
    (DECODE, ["--top-k", "-1"], "--top-k"),
    (DECODE, ["--max-new-tokens", "0"], "--max-new-tokens"),
    (DECODE, ["--limit", "0"], "--limit"),
    (DECODE, ["--show", "-1"], "--show"),
    (DECODE, ["--seed", "-1"], "--seed"),
    (SAMPLE, ["--max-new-tokens", "0"], "--max-new-tokens"),
    (SAMPLE, ["--temperature", "-1"], "--temperature"),
    (["target", "build", "tiny"], ["--seed", "-1"], "--seed"),
    (["demo"], ["--epochs", "0"], "--epochs"),
    (["demo"], ["--block-size", "1"], "--block-size"),
    (["demo"], ["--lr", "-1e-3"], "--lr"),
    (["demo"], ["--num-anchors", "0"], "--num-anchors"),
    (["demo"], ["--temperature", "-1"], "--temperature"),
    (["demo"], ["--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo"], ["--seed", "-1"], "--seed"),
    (["eval", "--target", "m", "--rollouts", "r", "ngram"], ["--threads", "0"], "--threads"),
]


@pytest.mark.parametrize(
    "base,bad,flag", BAD_FLAGS, ids=[f"{b[0]}{' '.join(x)}" for b, x, _ in BAD_FLAGS]
)
def test_bad_flag_value_is_one_line_naming_the_flag(base, bad, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # every relative path above would land here
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, *base, *bad)
    assert exc.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"error: argument {flag}"), line
    assert os.listdir(tmp_path) == []  # refused while parsing: nothing ran, nothing written


def test_good_values_still_parse():
    from blockdraft.cli import build_parser

    args = build_parser().parse_args(
        [*ROLLOUT, "--temperature", "0", "--top-p", "1", "--top-k", "0", "--store-topk", "0"]
    )
    assert (args.temperature, args.top_p, args.top_k, args.store_topk) == (0.0, 1.0, 0, 0)
    args = build_parser().parse_args([*IMPORT, "--top-k", "-1"])  # vLLM's "off"
    assert args.top_k == -1


# (override, the key the ConfigError must name)
BAD_KEYS = [
    ("optim.batch_size=3 optim.grad_accum=2", "optim.batch_size"),
    ("optim.lr=.inf", "optim.lr"),
    ("optim.lr=.nan", "optim.lr"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("optim.betas=[0.9,1.0]", "optim.betas"),
    ("optim.epochs=.inf", "optim.epochs"),
    ("drafter.markov_rank=0", "drafter.markov_rank"),
    ("drafter.draft_vocab_size=0", "drafter.draft_vocab_size"),
    ("target.layer_ids=[]", "target.layer_ids"),
    ("target.layer_ids=[-1]", "target.layer_ids"),
    ("eval.every=-1", "eval.every"),
    ("eval.max_rollouts=0", "eval.max_rollouts"),
    ("checkpoint.save_every=-5", "checkpoint.save_every"),
    ("seed=-1", "seed"),
    ("objective.alpha=1.5", "objective.alpha"),
    ("distributed.timeout_minutes=.inf", "distributed.timeout_minutes"),
]


@pytest.mark.parametrize("override,key", BAD_KEYS)
def test_bad_train_key_is_refused_naming_it(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(REPO / "configs" / "tiny.yaml", ["data.train_rollouts=r", *override.split()])
    assert str(exc.value).startswith(f"{key}:"), exc.value


def test_bad_train_key_on_the_command_line_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for override, key in BAD_KEYS:
        code, _, err = run_cli(
            capsys, "train", "--config", REPO / "configs" / "tiny.yaml",
            f"run_dir={run_dir}", "data.train_rollouts=r", *override.split(),
        )  # fmt: skip
        assert code == 2 and one_line_error(err).startswith(f"error: {key}:"), err
        assert not run_dir.exists()


def test_allow_changed_needs_resume(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "train", "--config", REPO / "configs" / "tiny.yaml", f"run_dir={tmp_path / 'r'}",
        "data.train_rollouts=r", "--allow-changed", "objective.name",
    )  # fmt: skip
    assert code == 2 and "--allow-changed" in one_line_error(err)


# --- SIGTERM -------------------------------------------------------------------------


def _stage_that_gets_sigterm(args):
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt the stage")


class _NotHandledByTheCli(Exception):
    pass


def _outside_handler(signum, frame):
    raise _NotHandledByTheCli()


def test_sigterm_is_handled_like_ctrl_c(monkeypatch, capsys):
    import blockdraft.cli.report as report_cli

    monkeypatch.setattr(report_cli, "run", _stage_that_gets_sigterm)
    # the caller's own handler (it would be reached if the CLI left SIGTERM alone)
    before = signal.signal(signal.SIGTERM, _outside_handler)
    try:
        code, _, err = run_cli(capsys, "report", "--out", "nowhere")
    finally:
        restored = signal.signal(signal.SIGTERM, before)
    assert code == 143  # 128 + SIGTERM, what a shell reports for a process it terminated
    assert "terminated (SIGTERM); finished work is kept and the run can be resumed" in err
    assert "Traceback" not in err
    assert restored is _outside_handler  # the caller's handler is back
