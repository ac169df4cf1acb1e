"""`--device` / `--dtype` on `eval`, `compare` and `decode` (blockdraft.devices).

CPU only: the flags parse, reach the models (the target *and* the drafter run in the
requested dtype on the requested device), bf16 results stay close to fp32 ones, and bad
values are one line naming the flag. A spy on the per-rollout scorer records what the
models actually ran in.
"""

from __future__ import annotations

import json

import pytest
import torch

import blockdraft.cli.decode as decode_cli
import blockdraft.decoding.loop as online
import blockdraft.evaluation.scoring as scoring
from blockdraft.devices import drafter_dtype, resolve_device, resolve_dtype
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli, save_local_model, save_random_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A local target, greedy rollouts of it and two random drafters (saved in fp32)."""
    root = tmp_path_factory.mktemp("device")
    model = save_local_model(root / "target")
    target = load_target(str(model))
    rollouts = make_rollouts(target, root / "rollouts", n=4, tokens=12)
    torch.manual_seed(1)
    a = save_random_drafter(target, root / "a")
    torch.manual_seed(2)
    b = save_random_drafter(target, root / "b")
    return root, model, rollouts, a, b


@pytest.fixture
def seen(monkeypatch):
    """(target dtype, target device, drafter dtype, drafter device) of every scored rollout."""
    calls: list[tuple] = []
    real = scoring.acceptance_tensor

    def spy(drafter, target, *args, **kwargs):
        p = next(drafter.parameters())
        calls.append((target.dtype, target.device.type, p.dtype, p.device.type))
        return real(drafter, target, *args, **kwargs)

    monkeypatch.setattr(scoring, "acceptance_tensor", spy)
    return calls


def _eval(capsys, setup, *extra: str) -> tuple[int, str, str]:
    root, model, rollouts, a, _ = setup
    return run_cli(capsys, "eval", "--target", model, "--rollouts", rollouts, a, "--threads", "1",
                   "--no-progress", "--cache-dir", root / "cache", *extra)  # fmt: skip


def _mal(out_json) -> float:
    return json.loads(out_json.read_text())["benchmarks"][0]["drafters"][0]["mal"]


@pytest.mark.parametrize("stage", ["eval", "compare", "decode", "demo", "rollout", "features"])
def test_every_model_stage_has_device_and_dtype(stage, capsys) -> None:
    with pytest.raises(SystemExit):
        run_cli(capsys, stage, "--help")
    text = capsys.readouterr().out
    assert "--device" in text and "--dtype" in text and "bfloat16" in text


def test_eval_bf16_runs_target_and_drafter_in_bf16_close_to_fp32(setup, seen, capsys) -> None:
    root = setup[0]
    code, _, err = _eval(capsys, setup, "--device", "cpu", "--json", root / "fp32.json")
    assert code == 0, err
    assert seen and all(c == (torch.float32, "cpu", torch.float32, "cpu") for c in seen)
    seen.clear()
    code, _, err = _eval(capsys, setup, "--device", "cpu", "--dtype", "bfloat16",
                         "--json", root / "bf16.json")  # fmt: skip
    assert code == 0, err
    assert seen and all(c == (torch.bfloat16, "cpu", torch.bfloat16, "cpu") for c in seen)
    # a separate cache entry (not the fp32 numbers served back), close to fp32's
    assert len(list((root / "cache").glob("*.safetensors"))) == 2
    assert _mal(root / "bf16.json") == pytest.approx(_mal(root / "fp32.json"), abs=0.15)


def test_compare_passes_the_dtype_to_every_drafter(setup, seen, capsys) -> None:
    root, model, rollouts, a, b = setup
    code, _, err = run_cli(capsys, "compare", "--target", model, "--rollouts", rollouts, a, b,
                           "--dtype", "bfloat16", "--no-progress", "--n-boot", "50",
                           "--cache-dir", root / "cache-cmp")  # fmt: skip
    assert code == 0, err
    assert len(seen) == 2 * 4  # two drafters x four rollouts
    assert all(c[0] == torch.bfloat16 and c[2] == torch.bfloat16 for c in seen)


def test_decode_runs_both_models_in_the_requested_dtype(setup, monkeypatch, capsys) -> None:
    root, model, rollouts, a, _ = setup
    ran: list[tuple] = []
    real = online.decode

    def spy(target, drafter, *args, **kwargs):
        ran.append((target.dtype, drafter.dtype, drafter.fc.weight.device.type))
        return real(target, drafter, *args, **kwargs)

    monkeypatch.setattr(decode_cli, "decode", spy)
    argv = ["decode", "--target", model, "--drafter", a, "--rollouts", rollouts, "--dtype",
            "bfloat16", "--no-ar", "--no-progress", "--json", root / "dec.json"]  # fmt: skip
    code, out, err = run_cli(capsys, *argv, "--cache-dir", root / "cache-dec")
    assert code == 0, err
    assert ran == [(torch.bfloat16, torch.bfloat16, "cpu")]
    res = json.loads((root / "dec.json").read_text())
    assert res["tau"] >= 1.0 and "offline_mal" in res


@pytest.mark.parametrize(
    "device",
    ["bogus", "cuda:0" if not torch.cuda.is_available() else "xpu9", "meta", "mps", "tpu", "cpu:0"],
)
def test_bad_device_is_one_line_naming_the_flag(setup, device, capsys) -> None:
    """Only blockdraft's devices: torch's other types (`meta`, `mps`) would load the
    models and fail later in a traceback, and torch's message lists its internal types."""
    code, _, err = _eval(capsys, setup, "--device", device)
    assert code == 2
    line = one_line_error(err)
    assert line.startswith("error: --device")
    if device != "cuda:0":
        assert "auto, cpu, cuda, cuda:N" in line and "privateuseone" not in line


def test_bad_dtype_is_refused_by_the_parser(setup, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _eval(capsys, setup, "--dtype", "float8")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --dtype: invalid choice" in err


def test_resolution_rules() -> None:
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16  # no GPU needed to decide
    assert resolve_dtype("float16", cpu) == torch.float16
    assert drafter_dtype("auto", cpu) is None  # CPU keeps a checkpoint's own dtype
    assert drafter_dtype("auto", "cuda:1") == torch.bfloat16
    assert drafter_dtype("float32", cpu) == torch.float32
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8", cpu)


@pytest.mark.parametrize(("flag", "value"), [("--device", "bogus"), ("--dtype", "float8")])
def test_demo_refuses_bad_values_before_loading_anything(flag, value, tmp_path, capsys) -> None:
    try:  # --dtype has choices: argparse refuses it while parsing (SystemExit)
        code, _, err = run_cli(
            capsys, "demo", "--out", tmp_path / "d", "--target", "missing", flag, value
        )
    except SystemExit as exc:
        code, err = exc.code, capsys.readouterr().err
    assert code == 2
    line = one_line_error(err)
    assert line.startswith((f"error: {flag}", f"error: argument {flag}")), line


def test_demo_stage_keys_ignore_auto_devices(tmp_path) -> None:
    """Demo directories made before `--device`/`--dtype` existed keep their stages."""
    from blockdraft.pipeline.demo import DemoSettings, _settings_key, _train_config

    rollouts = {"train": tmp_path / "t", "eval": tmp_path / "e"}
    key = _settings_key(DemoSettings(), tmp_path)
    assert "device" not in key and "dtype" not in key
    assert _settings_key(DemoSettings(dtype="bfloat16"), tmp_path)["dtype"] == "bfloat16"
    default = _train_config(DemoSettings(), tmp_path, rollouts, [], None).to_dict()
    assert default["device"] == "auto" and default["target"]["dtype"] == "auto"
    cfg = _train_config(DemoSettings(device="cpu", dtype="bfloat16"), tmp_path, rollouts, [], None)
    assert cfg.device == "cpu" and cfg.target.dtype == "bfloat16"


def test_features_device_defaults_to_auto_and_bad_values_are_one_line(tmp_path, capsys) -> None:
    from blockdraft.cli import build_parser

    args = build_parser().parse_args(["features", "--target", "t", "--rollouts", "r", "--out", "o"])
    # --dtype not given: None, which the command reads as auto (tests/cli/test_cli_flags.py)
    assert (args.device, args.dtype, args.target_dtype) == ("auto", None, None)
    argv = ["features", "--target", "missing", "--rollouts", tmp_path, "--out", tmp_path / "f"]
    code, _, err = run_cli(capsys, *argv, "--device", "bogus")
    assert code == 2 and one_line_error(err).startswith("error: --device 'bogus'")
