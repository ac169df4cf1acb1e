"""Files a user names as outputs never replace what is already there: every `--json`
(and `suite --plot`) refuses an existing file unless `--overwrite`, before any work, is
written atomically (a full disk leaves the old file or none, and names the path), and a
report's PNGs are never left cut short."""

from __future__ import annotations

import json

import pytest

from blockdraft.targets.registry import load_target
from clikit import make_rollouts, one_line_error, run_cli
from diskkit import full_disk_for


@pytest.fixture(scope="module")
def tiny_rollouts(tmp_path_factory):
    target = load_target("tiny", progress=False)
    return make_rollouts(target, tmp_path_factory.mktemp("r") / "set", n=4, tokens=8)


def _weights(tmp_path):
    precious = tmp_path / "final" / "model.safetensors"
    precious.parent.mkdir()
    precious.write_bytes(b"trained weights")
    return precious


COMMANDS = {
    "eval": ["eval", "--target", "tiny", "--rollouts", "{r}", "ngram"],
    "compare": ["compare", "--target", "tiny", "--rollouts", "{r}", "ngram", "ngram:k=3"],
    "decode": ["decode", "--target", "tiny", "ngram", "--rollouts", "{r}"],
    "suite": ["suite", "--target", "tiny", "--benchmark", "b=stdlib:eval"],
    "serve-check": ["serve-check", "--target", "tiny", "{r}", "--rollouts", "{r}"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_refuses_an_existing_file_before_any_work(tmp_path, capsys, tiny_rollouts, command):
    precious = _weights(tmp_path)
    argv = [a.replace("{r}", str(tiny_rollouts)) for a in COMMANDS[command]]
    code, out, err = run_cli(capsys, *argv, "--no-progress", "--json", precious)
    assert code == 2
    line = one_line_error(err)
    assert str(precious) in line and "--overwrite" in line
    assert precious.read_bytes() == b"trained weights"
    assert out == ""  # refused before anything ran


def test_json_overwrite_replaces_and_a_new_path_is_written(tmp_path, capsys, tiny_rollouts):
    precious = _weights(tmp_path)
    base = ["eval", "--target", "tiny", "--rollouts", tiny_rollouts, "ngram", "--no-progress"]
    code, _, err = run_cli(capsys, *base, "--n-boot", "20", "--json", precious, "--overwrite")
    assert code == 0, err
    assert json.loads(precious.read_text())["benchmarks"][0]["drafters"][0]["name"] == "ngram"
    fresh = tmp_path / "new" / "eval.json"
    code, _, err = run_cli(capsys, *base, "--n-boot", "20", "--json", fresh)
    assert code == 0, err
    assert json.loads(fresh.read_text())["benchmarks"]


def test_json_on_a_full_disk_names_the_path_and_leaves_the_old_file(
    tmp_path, capsys, tiny_rollouts, monkeypatch
):
    old = tmp_path / "eval.json"
    old.write_text('{"old": true}\n')
    full_disk_for(monkeypatch, ".json.tmp")
    code, _, err = run_cli(
        capsys,
        *["eval", "--target", "tiny", "--rollouts", tiny_rollouts, "ngram", "--no-progress"],
        *["--n-boot", "20", "--json", old, "--overwrite"],
    )
    assert code == 2
    line = one_line_error(err)
    assert str(old) in line and "disk is full" in line
    assert old.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]  # no temp file left


def test_suite_plot_refuses_an_existing_file(tmp_path, capsys):
    precious = _weights(tmp_path)
    code, out, err = run_cli(
        capsys, "suite", "--target", "tiny", "--benchmark", "b=stdlib:eval", "--plot", precious
    )
    assert code == 2 and str(precious) in one_line_error(err)
    assert precious.read_bytes() == b"trained weights"


def test_a_plot_on_a_full_disk_leaves_no_cut_short_png(tmp_path, monkeypatch):
    from blockdraft.pipeline.report_plots import plot_acceptance_rates

    full_disk_for(monkeypatch, ".png.tmp")
    path = tmp_path / "report" / "acceptance.png"
    drafter = {"name": "a", "ar_k": [0.5, 0.25], "mal": 1.5, "mal_ci95": [1.4, 1.6]}
    with pytest.raises(OSError) as info:
        plot_acceptance_rates([drafter], path)
    assert str(path) in str(info.value.filename)
    assert not path.exists() and list(path.parent.iterdir()) == []


def _eval_json(tmp_path, benchmarks):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return path


@pytest.mark.parametrize(
    ("benchmarks", "says"),
    [
        (5, "'benchmarks' is 5, not a list"),
        ([3], "benchmarks[0] is 3"),
        ([{"name": "b", "drafters": 1}], "benchmarks[0].drafters is 1"),
        ([{"name": "b", "drafters": [{"name": "x", "mal": "high"}]}], "numeric 'mal'"),
    ],
)
def test_report_of_a_malformed_eval_json_is_one_line(tmp_path, capsys, benchmarks, says):
    path = _eval_json(tmp_path, benchmarks)
    code, _, err = run_cli(capsys, "report", "--eval", path, "--out", tmp_path / "rep")
    assert code == 2
    line = one_line_error(err)
    assert str(path) in line and says in line


def test_report_out_onto_a_file_says_it_is_a_file(tmp_path, capsys):
    path = _eval_json(tmp_path, [{"name": "b", "drafters": [{"name": "x", "mal": 1.5}]}])
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    code, _, err = run_cli(capsys, "report", "--eval", path, "--out", mine)
    assert code == 2
    assert "is a file, not a directory" in one_line_error(err)
    assert mine.read_text() == "mine"
