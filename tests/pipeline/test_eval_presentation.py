"""What `eval`, `compare` and `report` show (issue 16): every AR_k of the drafters' own K,
labelled progress bars, units on relative CIs, visible single-point series, integer steps,
the D-PACE weight panel only for D-PACE runs, and drafters trained on other target layers
evaluated with their own layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from blockdraft.pipeline import report_plots
from blockdraft.pipeline.report import comparison_table, offline_table, write_report
from blockdraft.targets.registry import load_target
from clikit import make_rollouts, run_cli, save_local_model, save_random_drafter


def test_offline_table_shows_every_proposal_slot():
    d = {"name": "a", "mal": 2.0, "mal_ci95": [1.9, 2.1], "expected_rounds": 10.0}
    lines = offline_table([{**d, "ar_k": [0.5] * 15}])
    assert "AR_15 |" in lines[0] and lines[0].count("AR_") == 15


def test_relative_ci_carries_its_unit():
    c = {
        "a": "x",
        "b": "y",
        "mal_a": 2.0,
        "mal_b": 2.1,
        "mal_gain": 0.1,
        "mal_gain_ci95": [0.0, 0.2],
        "rel_gain": 0.05,
        "rel_gain_ci95": [0.01, 0.09],
    }
    row = comparison_table([c])[-1]
    assert "[1.00%, 9.00%]" in row and "5.00%" in row


def test_compare_json_written_before_mal_gain_still_renders():
    """`blockdraft report --compare` on a file whose gain is still called `diff`."""
    new = {"a": "x", "b": "y", "mal_a": 2.0, "mal_b": 2.1, "mal_gain": 0.1234,
           "mal_gain_ci95": [0.0111, 0.2222], "rel_gain": None}  # fmt: skip
    old = {k: v for k, v in new.items() if not k.startswith("mal_gain")}
    old |= {"diff": new["mal_gain"], "diff_ci95": new["mal_gain_ci95"]}
    assert comparison_table([old]) == comparison_table([new])
    assert "0.1234" in comparison_table([old])[-1]


def _capture(monkeypatch):
    figs = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: figs.append(fig) or path)
    return figs


def test_single_point_series_are_visible_and_steps_integer(monkeypatch):
    figs = _capture(monkeypatch)
    report_plots.plot_training_curves(
        {"edr": {"loss": [(3, 0.7)], "eval_mal": [(3, 2.0)]}}, Path("x.png")
    )
    _, ax_loss = figs[0].axes[:2]
    (line,) = ax_loss.get_lines()
    assert line.get_marker() not in (None, "None", "")
    for ax in figs[0].axes[:2]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def _run(root: Path, name: str, objective: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "run.yaml").write_text(yaml.safe_dump({"objective": {"name": objective}}))
    events = [
        {"step": s, "event": "train", "loss": 1.0 / s, "dpace_weight_profile": [0.5, 0.3, 0.2]}
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return run / "metrics.jsonl"


def test_dpace_weight_panel_only_for_dpace_runs(tmp_path):
    out = tmp_path / "report"
    write_report(out, [], [], {"edr": _run(tmp_path, "edr", "edr")}, {})
    assert not (out / "dpace_weight_profile.png").exists()
    assert "D-PACE" not in (out / "report.md").read_text()
    write_report(out, [], [], {"dpace": _run(tmp_path, "dpace", "dpace")}, {})
    assert (out / "dpace_weight_profile.png").exists()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    model = save_local_model(root / "model")
    target = load_target(str(model), progress=False)
    rollouts = make_rollouts(target, root / "r", n=4, shard_size=4)
    default = save_random_drafter(target, root / "default")
    target.layer_ids = [0, 1, 2, 3]  # as trained with target.layer_ids=[0,1,2,3]
    other = save_random_drafter(target, root / "all-layers")
    return {"model": model, "rollouts": rollouts, "drafters": [default, other]}


def test_drafters_on_other_layers_are_evaluated_with_their_own(local, tmp_path, capsys):
    code, out, err = run_cli(
        capsys,
        "compare",
        "--target",
        local["model"],
        "--rollouts",
        local["rollouts"],
        *local["drafters"],
        "--n-boot",
        "20",
        "--cache-dir",
        tmp_path / "c",
    )
    assert code == 0, err
    assert "all-layers" in out
    assert "scoring default" in err and "scoring all-layers" in err  # labelled bars
    code, out, err = run_cli(
        capsys,
        "eval",
        "--target",
        local["model"],
        "--rollouts",
        local["rollouts"],
        local["drafters"][1],
        "--no-progress",
        "--n-boot",
        "20",
        "--cache-dir",
        tmp_path / "c",
    )
    assert code == 0, err
