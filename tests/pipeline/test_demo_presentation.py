"""What the CPU demo prints and draws: no GPU-sized note for its small trainings, and a
training-curve figure that says how many held-out rollouts its MAL is measured on and
keeps short fine-tunes off the long runs' x-axis."""

from __future__ import annotations

from pathlib import Path

import torch

from blockdraft.pipeline import report_plots
from blockdraft.pipeline.demo import DemoSettings, _train_config
from blockdraft.pipeline.report import training_series
from blockdraft.training.builders import cpu_fallback_note
from blockdraft.training.config import config_from_dict

CPU = torch.device("cpu")


def test_the_demos_trainings_print_no_gpu_sized_note(tmp_path):
    rollouts = {"train": tmp_path / "t", "eval": tmp_path / "e"}
    cfg = _train_config(DemoSettings(), tmp_path / "run", rollouts, [], None)
    assert cfg.device == "auto" and cfg.data.max_seq_len > 1024  # the default cap
    assert cpu_fallback_note(cfg, CPU) is None
    # a long cap alone is no reason; a costly setting is, and the cap is named beside it
    base = ["data.train_rollouts=R", "num_anchors=64"]
    assert cpu_fallback_note(config_from_dict({}, [*base, "data.max_seq_len=4096"]), CPU) is None
    note = cpu_fallback_note(config_from_dict({}, [*base, "drafter.num_layers=3"]), CPU)
    assert "drafter.num_layers=3" in note and "data.max_seq_len=2048" in note


def _curves(steps: int, mal: float) -> dict:
    events = [{"step": s, "loss": 1.0 / s} for s in range(1, steps + 1, max(1, steps // 8))]
    events += [{"step": steps, "event": "eval", "eval_mal": mal, "eval_rollouts": 32}]
    return training_series(events)


def test_short_and_long_runs_get_their_own_panels(monkeypatch):
    figs = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: figs.append(fig) or path)
    curves = {
        "dpace": _curves(576, 3.0),
        "decay": _curves(560, 2.8),
        "edr": _curves(48, 3.2),
        "e2e": _curves(48, 3.1),
    }
    groups = [sorted(g) for g in report_plots.length_groups(curves)]
    assert groups == [["e2e", "edr"], ["decay", "dpace"]]
    report_plots.plot_training_curves(curves, Path("x.png"))
    axes = figs[0].axes
    assert len(axes) == 4  # one row of (MAL, loss) per group
    short, long = axes[0], axes[2]
    assert short.get_xlim()[1] < 100 < long.get_xlim()[1]
    assert {ln.get_label() for ln in short.get_lines()} == {"e2e", "edr"}
    assert "on 32 held-out rollouts" in short.get_title() and "edr" in short.get_title()


def test_one_group_keeps_one_row_and_says_the_held_out_count(monkeypatch):
    figs = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: figs.append(fig) or path)
    report_plots.plot_training_curves({"a": _curves(100, 2.0)}, Path("x.png"))
    assert len(figs[0].axes) == 2
    assert figs[0].axes[0].get_title() == "mean accepted length on 32 held-out rollouts"
