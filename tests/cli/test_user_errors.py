"""User and file errors end in one line naming the file, line or key, never a traceback
(issue 16: non-UTF-8 prompt files, `target sample --chat` without a template, missing
paths)."""

from __future__ import annotations

import pytest

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.prompt_type import PromptError
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


class _Planted:
    """A pickle that would create `path` when unpickled without weights_only."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tiny_train(capsys, model, rollouts, run_dir, *extra):
    return run_cli(
        capsys, "train", f"target.name={model}", f"data.train_rollouts={rollouts}",
        f"run_dir={run_dir}", "drafter.block_size=4", "optim.batch_size=2", "num_anchors=4",
        "logging.progress=false", "logging.tensorboard=false", "eval.every=0", *extra,
    )  # fmt: skip


def test_code_in_trainer_state_on_resume_is_one_line(tmp_path, capsys):
    """`trainer_state.pt` is loaded with weights_only, which blocks a planted pickle; the
    refusal is one line naming the file, not torch's UnpicklingError traceback."""
    import hashlib
    import json
    import pickle

    from blockdraft.targets.registry import load_target
    from clikit import make_rollouts

    model = save_local_model(tmp_path / "m")
    rollouts = make_rollouts(load_target(str(model), progress=False), tmp_path / "r", n=4)
    run = tmp_path / "run"
    code, _, err = _tiny_train(
        capsys, model, rollouts, run, "optim.max_steps=2", "checkpoint.save_every=2"
    )
    assert code == 0, err
    (step,) = (run / "checkpoints").iterdir()
    planted = tmp_path / "planted"
    data = pickle.dumps(_Planted(planted))
    (step / "trainer_state.pt").write_bytes(data)
    state = json.loads((step / "trainer_state.json").read_text())  # records updated too
    state["files"]["trainer_state.pt"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (step / "trainer_state.json").write_text(json.dumps(state))
    code, _, err = _tiny_train(capsys, model, rollouts, run, "optim.max_steps=4", "--resume")
    line = one_line_error(err)
    assert code == 2 and str(step / "trainer_state.pt") in line and "weights_only=False" not in line
    assert not planted.exists()


def _custom_code_model(tmp_path):
    import json

    model = save_local_model(tmp_path / "custom")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="made_up", architectures=["MadeUpForCausalLM"])
    cfg["auto_map"] = {"AutoConfig": "conf.MadeUpConfig", "AutoModelForCausalLM": "mod.MadeUp"}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "mod.py").write_text("raise SystemExit('custom code ran')\n")
    (model / "conf.py").write_text("raise SystemExit('custom code ran')\n")
    return model


def test_target_with_custom_code_is_one_line(tmp_path, capsys):
    import json

    model = _custom_code_model(tmp_path)
    code, _, err = run_cli(capsys, "target", "info", model)
    line = one_line_error(err)
    assert code == 2 and str(model) in line and "--trust-remote-code" in line
    code, _, err = _tiny_train(capsys, model, tmp_path / "no-rollouts", tmp_path / "run")
    line = one_line_error(err)
    assert code == 2 and "target.name" in line and "own code" in line
    cfg = json.loads((model / "config.json").read_text())
    del cfg["auto_map"]  # an unknown model type and no code for it: one line too
    (model / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "target", "info", model)
    assert code == 2 and "'made_up'" in one_line_error(err)


def test_target_with_only_a_planted_pickle_is_one_line(tmp_path, capsys):
    import pickle

    model = save_local_model(tmp_path / "m")
    (model / "model.safetensors").unlink()
    planted = tmp_path / "planted"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(planted)))
    code, _, err = run_cli(capsys, "target", "info", model)
    line = one_line_error(err)
    assert code == 2 and "pytorch_model.bin" in line and "weights_only=False" not in line
    assert not planted.exists()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda s: s.update(bogus=1), "'bogus'"),
        (lambda s: s.update(step="10"), "'step'"),
        (lambda s: s.pop("step"), "'step'"),
    ],
)
def test_edited_trainer_state_json_on_resume_is_one_line(tmp_path, capsys, edit, says):
    import json

    from blockdraft.errors import CheckpointError
    from blockdraft.training.step_checkpoint import read_progress

    (tmp_path / "trainer_state.json").write_text(
        json.dumps({"step": 10, "tokens_seen": 5, "best_mal": None, "best_step": None})
    )
    assert read_progress(tmp_path).step == 10
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    edit(state)
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'trainer_state.json'}: .*{says}"):
        read_progress(tmp_path)


def test_target_sample_of_an_empty_prompt_is_one_line(capsys):
    code, _, err = run_cli(
        capsys, "target", "sample", "tiny", "--prompt", "", "--max-new-tokens", "2"
    )
    assert code == 2 and "--prompt '': no tokens" in one_line_error(err)
