"""User and file errors end in one line naming the file, line or key, never a traceback
(issue 16: non-UTF-8 prompt files, `target sample --chat` without a template, missing
paths)."""

from __future__ import annotations

import pytest

from blockdraft.data.prompts import PromptError, load_prompts
from clikit import one_line_error, run_cli, save_local_model


def test_non_utf8_prompt_file_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptError, match=rf"{f}:2: not UTF-8 text"):
        load_prompts(f"{f}:prompt")
    g = tmp_path / "p.json"
    g.write_bytes(b'[\n{"prompt": "ok"},\n{"prompt": "caf\xe9"}\n]\n')
    with pytest.raises(PromptError, match=rf"{g}:3: not UTF-8 text"):
        load_prompts(f"{g}:prompt")


def test_target_sample_chat_without_template_is_one_line(tmp_path, capsys):
    model = save_local_model(tmp_path / "m")
    code, _, err = run_cli(capsys, "target", "sample", model, "--chat", "--max-new-tokens", "2")
    assert code == 2 and "--chat: target" in one_line_error(err)
    code, out, err = run_cli(capsys, "target", "sample", model, "--max-new-tokens", "2")
    assert code == 0, err


def test_missing_paths_are_one_line(tmp_path, capsys):
    model = save_local_model(tmp_path / "m")
    code, _, err = run_cli(
        capsys, "eval", "--target", model, "--rollouts", tmp_path / "nope", "ngram", "--no-progress"
    )
    assert code == 2 and str(tmp_path / "nope") in one_line_error(err)
    code, _, err = run_cli(capsys, "export", tmp_path / "no-run", "--check")
    assert code == 2 and "no-run" in one_line_error(err)
    code, _, err = run_cli(capsys, "train", "--config", tmp_path / "none.yaml")
    assert code == 2 and "none.yaml" in one_line_error(err)
