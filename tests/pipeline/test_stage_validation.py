"""Silently wrong or confusing stage behaviour found by issue 29, each as a test: prompts
longer than the target's context, decode on another target's rollouts, a SIGTERM during
`rollout` and its resume, an empty engine choice on import, fp16 fingerprints, transformers'
own progress bar under --no-progress, and one exit code for user errors."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from clikit import (
    make_rollouts,
    one_line_error,
    prompts,
    run_cli,
    save_local_model,
    save_random_drafter,
)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    from blockdraft.targets.registry import load_target

    root = tmp_path_factory.mktemp("stages")
    model = save_local_model(root / "model")  # max_position_embeddings 1024
    other = save_local_model(root / "other", seed=1)
    target = load_target(str(model), progress=False)
    other_target = load_target(str(other), progress=False)
    return {
        "root": root,
        "model": model,
        "target": target,
        "other_rollouts": make_rollouts(other_target, root / "other-r", n=4),
        "drafter": save_random_drafter(target, root / "drafter"),
    }


def _prompt_file(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f"{path}:prompt"


def _rollout(capsys, local, spec, out, *extra):
    return run_cli(
        capsys, "rollout", "--target", local["model"], "--prompts", spec, "--out", out,
        "--temperature", "0", "--max-new-tokens", "8", "--no-progress", *extra,
    )  # fmt: skip


def test_prompt_longer_than_the_context_is_refused_before_generating(local, tmp_path, capsys):
    spec = _prompt_file(
        tmp_path / "p.jsonl",
        [{"id": "short", "prompt": "def f(x):"}, {"id": "long", "prompt": "x " * 2000}],
    )
    out = tmp_path / "r"
    code, _, err = _rollout(capsys, local, spec, out)
    line = one_line_error(err)
    assert code == 2
    assert "prompt 'long' (prompt 2 of 2)" in line and "context of 1024 tokens" in line, line
    assert not out.exists()  # nothing generated, nothing written
    # prompt + max_new_tokens past the context: refused too, with the largest budget that fits
    n = len(local["target"].tokenizer("x " * 1000)["input_ids"])
    spec = _prompt_file(tmp_path / "q.jsonl", [{"id": "near", "prompt": "x " * 1000}])
    code, _, err = _rollout(capsys, local, spec, out, "--max-new-tokens", "100")
    line = one_line_error(err)
    assert code == 2 and f"lower --max-new-tokens to {1024 - n}" in line, line
    # decode checks its prompts the same way
    code, _, err = run_cli(
        capsys, "decode", "--target", local["model"], "--drafter", local["drafter"],
        "--prompts", spec, "--max-new-tokens", "100", "--no-progress", "--no-ar",
    )  # fmt: skip
    assert code == 2 and "prompt 'near'" in one_line_error(err)


def test_decode_refuses_another_targets_rollouts(local, capsys):
    code, _, err = run_cli(
        capsys, "decode", "--target", local["model"], "--drafter", local["drafter"],
        "--rollouts", local["other_rollouts"], "--no-progress", "--no-ar",
    )  # fmt: skip
    line = one_line_error(err)
    assert code == 2 and "--rollouts:" in line and "other weights" in line, line


class _SigtermReachedTheCaller(Exception):
    pass


def _caller_handler(signum, frame):
    raise _SigtermReachedTheCaller()


def test_sigterm_during_rollout_keeps_finished_shards_and_resumes(
    local, tmp_path, capsys, monkeypatch
):
    import blockdraft.data.rollouts.generate as rollouts_mod
    from blockdraft.data.rollouts.store import RolloutSet

    spec = _prompt_file(tmp_path / "p.jsonl", [{"id": p.id, "prompt": p.text} for p in prompts(6)])
    record = rollouts_mod.finish_manifest

    def record_then_sigterm(*args, **kwargs):  # a scheduler stopping the job mid-run
        record(*args, **kwargs)  # the first shard is finished and in the manifest
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(rollouts_mod, "finish_manifest", record_then_sigterm)
    out = tmp_path / "r"
    args = ("--shard-size", "2", "--batch-size", "2")
    before = signal.signal(signal.SIGTERM, _caller_handler)  # reached only if the CLI has none
    try:
        code, _, err = _rollout(capsys, local, spec, out, *args)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 143 and "terminated (SIGTERM); finished work is kept" in err, err
    assert "Traceback" not in err
    monkeypatch.setattr(rollouts_mod, "finish_manifest", record)
    code, printed, err = _rollout(capsys, local, spec, out, *args)
    assert code == 0, err
    assert "resuming: 2 of 6 prompts already done" in printed
    code, printed, err = _rollout(capsys, local, spec, tmp_path / "whole", *args)
    assert code == 0 and "resuming" not in printed
    resumed, whole = RolloutSet.open(out), RolloutSet.open(tmp_path / "whole")
    assert [r.response_ids.tolist() for r in resumed] == [r.response_ids.tolist() for r in whole]


def test_import_drops_and_counts_an_empty_choice(local, tmp_path, capsys):
    lines = [
        {"id": "a", "prompt": "def f(x):", "choices": [{"text": " return x"}]},
        {"id": "b", "prompt": "import os", "choices": []},
        {"id": "c", "prompt": "class A:", "choices": [{"message": {"content": None}}]},
        {"id": "d", "prompt": "for i in", "choices": [{"text": " range(3):"}]},
    ]
    f = tmp_path / "responses.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, out, err = run_cli(
        capsys, "rollout-import", f, "--target", local["model"], "--out", tmp_path / "r",
        "--temperature", "1", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "imported 2 of 4 responses" in out and "2 empty response (line 2, 3)" in out
    # a line with no engine answer and no response at all is still a format error
    f.write_text(json.dumps({"id": "x", "prompt": "p"}) + "\n")
    code, _, err = run_cli(
        capsys, "rollout-import", f, "--target", local["model"], "--out", tmp_path / "r2",
        "--temperature", "1", "--no-progress",
    )  # fmt: skip
    assert code == 2 and f"{f}:1: no response found" in one_line_error(err)


def test_fingerprint_is_the_same_for_every_load_dtype(local):
    from blockdraft.targets.fingerprint import target_fingerprint
    from blockdraft.targets.registry import load_target

    fp32 = target_fingerprint(local["target"])
    for dtype in (torch.float16, torch.bfloat16):
        loaded = load_target(str(local["model"]), dtype=dtype, progress=False)
        assert target_fingerprint(loaded) == fp32, dtype
    changed = load_target(str(local["model"]), dtype=torch.float16, progress=False)
    with torch.no_grad():
        changed.model.model.layers[0].mlp.down_proj.weight[0, 0] += 0.5
    assert target_fingerprint(changed) != fp32  # other weights are still another target


def test_no_progress_silences_transformers_too(local, tmp_path, capsys):
    spec = _prompt_file(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f(x):"}])
    code, _, err = _rollout(capsys, local, spec, tmp_path / "r")
    assert code == 0, err
    assert "Loading weights" not in err and "rollouts:" not in err


def test_every_stage_exits_2_on_a_user_error(local, tmp_path, capsys):
    nope = tmp_path / "nope"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("not an export")
    m = local["model"]
    cases = [
        ("rollout", "--target", m, "--prompts", f"{nope}.jsonl", "--out", tmp_path / "o"),
        ("rollout-import", nope, "--target", m, "--out", tmp_path / "o"),
        ("features", "--target", m, "--rollouts", nope, "--out", tmp_path / "o"),
        ("train", "--config", f"{nope}.yaml"),
        ("eval", "--target", m, "--rollouts", nope, "ngram", "--no-progress"),
        ("compare", "--target", m, "--rollouts", nope, "ngram", "ngram:k=3", "--no-progress"),
        ("decode", "--target", m, "--drafter", nope, "--prompts", "x"),
        ("report", nope, "--out", tmp_path / "o"),
        ("export", nope, "--out", tmp_path / "o"),
        ("export", local["drafter"], "--out", tmp_path / "full"),  # was exit 1
        ("target", "info", nope),
    ]
    for argv in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, (argv, code, err)
        one_line_error(err)


def test_target_shaped_flags_name_the_flag(local, tmp_path, capsys):
    from blockdraft.data.rollouts import SamplingSettings, generate_rollouts

    rollouts = tmp_path / "r"
    generate_rollouts(
        local["target"], prompts(2), rollouts, SamplingSettings(0.0, max_new_tokens=4),
        progress=False,
    )  # fmt: skip
    code, _, err = run_cli(
        capsys, "features", "--target", local["model"], "--rollouts", rollouts,
        "--out", tmp_path / "f", "--layer-ids", "1", "99", "--no-progress",
    )  # fmt: skip
    assert code == 2 and one_line_error(err).startswith("error: --layer-ids: [99] out of range")
    assert not (tmp_path / "f").exists()
    code, _, err = run_cli(
        capsys, "target", "sample", local["model"], "--max-new-tokens", "2000"
    )  # was a transformers "friendly reminder" and 2,000 tokens past the context
    assert code == 2 and "lower --max-new-tokens to" in one_line_error(err)
