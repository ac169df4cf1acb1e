"""`blockdraft decode` with the n-gram drafter, and the shared `--threads` flag.

With `--rollouts` (greedy) the decoder's online tau must equal the drafter's offline MAL
on the same rollouts exactly: a deterministic drafter and a greedy target leave no noise.
"""

from __future__ import annotations

import json

import pytest
import torch

from blockdraft.targets.registry import load_target
from clikit import make_rollouts, run_cli, save_local_model, save_random_drafter


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_decode_ngram_spec_online_tau_equals_offline_mal(tmp_path, capsys) -> None:
    model = save_local_model(tmp_path / "target")
    rollouts = make_rollouts(load_target(str(model)), tmp_path / "rollouts", tokens=24)
    code, out, err = run_cli(
        capsys,
        "decode",
        "--target", model,
        "--drafter", "ngram:k=3,max=2,match=first",
        "--rollouts", rollouts,
        "--threads", "1",
        "--no-progress",
        "--vs-hf",
        "--json", tmp_path / "out.json",
    )  # fmt: skip
    assert code == 0, err
    assert torch.get_num_threads() == 1
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["drafter"].startswith("ngram")
    assert res["path"] is None
    assert res["tau"] == pytest.approx(res["offline_mal"], abs=1e-12)
    assert res["tau"] > 1.0  # the random target repeats itself: some proposals accepted
    assert "per round (ms)" in out and "AR steps" in out
    assert res["speedup_vs_hf"] == pytest.approx(res["speedup"] * res["ar_vs_hf"])
    assert "x HF generate" in out


def test_decode_bf16_drafter_beside_the_fp32_target(tmp_path, capsys) -> None:
    """`--drafter-dtype bfloat16` casts the drafter alone; the evaluator scores the same
    bf16 drafter, so online tau and offline MAL still agree exactly at T = 0."""
    model = save_local_model(tmp_path / "target")
    target = load_target(str(model))
    rollouts = make_rollouts(target, tmp_path / "rollouts", tokens=24)
    drafter = save_random_drafter(target, tmp_path / "drafter")
    code, out, err = run_cli(
        capsys,
        "decode",
        "--target", model,
        "--drafter", drafter,
        "--drafter-dtype", "bfloat16",
        "--rollouts", rollouts,
        "--threads", "1",
        "--no-progress",
        "--no-ar",
        "--json", tmp_path / "out.json",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["drafter_dtype"] == "bfloat16"
    assert res["tau"] == pytest.approx(res["offline_mal"], abs=1e-12)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, "decode", "--target", model, "--drafter", drafter,
                "--drafter-dtype", "int4", "--rollouts", rollouts)  # fmt: skip
    assert exit_info.value.code == 2 and "--drafter-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_threads_flag_rejects_non_positive_counts(bad, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "decode", "--target", "x", "--drafter", "ngram", "--prompts", "p",
                "--threads", bad)  # fmt: skip
    assert exc.value.code == 2
    assert "--threads" in capsys.readouterr().err


def test_default_threads_respects_the_environment(monkeypatch) -> None:
    from blockdraft.threads import configure_cpu, default_threads

    monkeypatch.setenv("BLOCKDRAFT_THREADS", "1")
    assert default_threads() == 1
    assert configure_cpu(None) == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("BLOCKDRAFT_THREADS")
    assert 1 <= default_threads() <= max(1, torch.get_num_threads())


def test_vs_hf_needs_the_ar_baseline_and_times_sampling_settings(tmp_path, capsys) -> None:
    """Without the AR baseline there is no ratio to convert: refused in one line before
    anything is decoded. With top-k sampling HF generate samples with the same top-k."""
    model = save_local_model(tmp_path / "target")
    common = ["decode", "--target", model, "--drafter", "ngram", "--prompts", "stdlib:eval",
              "--limit", "1", "--max-new-tokens", "4", "--no-progress", "--vs-hf"]  # fmt: skip
    code, out, err = run_cli(capsys, *common, "--no-ar")
    last = err.strip().splitlines()[-1]  # after HF's weight-loading bars
    assert code == 2 and last.startswith("error: --vs-hf") and "drop --no-ar" in last
    assert "tok/s" not in out  # nothing was decoded first
    code, out, err = run_cli(
        capsys, *common, "--temperature", "1", "--top-k", "5", "--json", tmp_path / "k.json"
    )
    assert code == 0, err
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["speedup_vs_hf"] == pytest.approx(res["speedup"] * res["ar_vs_hf"])
