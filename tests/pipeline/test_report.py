"""Report from plain data, and the eval/compare/decode/report commands end to end.

The end-to-end test saves a random target as a local HF directory, writes rollouts with
the real rollout generator, saves two drafters (one a copy of the other, one different)
and checks: eval's MAL equals `offline_stats` on freshly computed acceptances; compare of
a drafter with its identical copy gives a difference of exactly 0; decode with
`--rollouts` reports tau and the offline MAL; report writes every plot.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from blockdraft.cli import main
from blockdraft.pipeline.report import read_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(path, steps=5, k=4, broken=False):
    lines = []
    for s in range(1, steps + 1):
        prof = torch.softmax(torch.arange(k, 0, -1.0) * (1 - s / (steps + 1)), 0).tolist()
        lines.append(
            json.dumps(
                {
                    "step": s * 10,
                    "event": "train",
                    "loss": 3.0 / s,
                    "acc_k": [0.5] * k,
                    "dpace_weight_profile": prof,
                }
            )
        )
        if s % 2 == 0:
            lines.append(json.dumps({"step": s * 10, "event": "eval", "eval_mal": 1.5 + 0.1 * s}))
    if broken:
        lines.append('{"step": 70, "loss": ')  # a line cut by a crash
    path.write_text("\n".join(lines) + "\n")
    return path


def test_write_report_from_plain_data(tmp_path) -> None:
    drafters = [
        {
            "name": "dflash",
            "benchmark": "gsm8k",
            "mal": 2.5,
            "mal_ci95": [2.4, 2.6],
            "expected_rounds": 40.0,
            "ar_k": [0.8, 0.6, 0.5, None],
            "t_ge_k": [30, 20, 10, 0],
        },
        {
            "name": "dpace",
            "benchmark": "gsm8k",
            "mal": 2.7,
            "mal_ci95": [2.6, 2.8],
            "expected_rounds": 37.0,
            "ar_k": [0.85, 0.65, 0.55, 0.5],
            "t_ge_k": [32, 21, 12, 6],
        },
        {
            "name": "dflash",
            "benchmark": "mt-bench",
            "mal": 2.0,
            "mal_ci95": [1.9, 2.1],
            "expected_rounds": 50.0,
            "ar_k": [0.7, 0.5, 0.4, 0.3],
            "t_ge_k": [30, 15, 6, 2],
        },
    ]
    comparisons = [
        {
            "benchmark": "gsm8k",
            "a": "dflash",
            "b": "dpace",
            "mal_a": 2.5,
            "mal_b": 2.7,
            "mal_gain": 0.2,
            "mal_gain_ci95": [0.1, 0.3],
            "rel_gain": 0.08,
            "rel_gain_ci95": [0.04, 0.12],
        }
    ]
    online = {
        "dflash": {
            "tau": 2.45,
            "tau_ci95": [2.3, 2.6],
            "histogram": [0, 10, 8, 5, 3, 2],
            "tokens_per_s": 50.0,
            "ar_tokens_per_s": 25.0,
            "speedup": 2.0,
            "offline_mal": 2.5,
            "offline_mal_ci95": [2.4, 2.6],
        },
        "dpace": {
            "tau": 3.5,
            "tau_ci95": [3.4, 3.6],
            "histogram": [0, 5, 5, 6, 6, 8],
            "tokens_per_s": 60.0,
            "ar_tokens_per_s": 25.0,
            "speedup": 2.4,
            "speedup_ci95": [2.1, 2.7],
            "offline_mal": 2.7,
            "offline_mal_ci95": [2.6, 2.8],
        },
    }
    logs = {
        "dflash": _metrics(tmp_path / "a.jsonl"),
        "dpace": _metrics(tmp_path / "b.jsonl", broken=True),
    }
    md_path = write_report(tmp_path / "rep", drafters, comparisons, logs, online)
    md = md_path.read_text()
    for png in (
        "acceptance_rates.png",
        "accepted_lengths.png",
        "training_curves.png",
        "dpace_weight_profile.png",
    ):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, png
        assert f"]({png})" in md
    assert "| gsm8k | dflash | dpace | 2.500 | 2.700 | 0.2000 | [0.1000, 0.3000] | 8.00% |" in md
    assert "| dflash | 2.450 | [2.300, 2.600] | 2.500 | [2.400, 2.600] | yes |" in md
    assert (
        "| dpace | 3.500 | [3.400, 3.600] | 2.700 | [2.600, 2.800] | **no** |" in md
    )  # CIs disjoint
    assert "| 60.0 | 2.40x | [2.10, 2.70] | –" in md  # the speedup's CI over prompts
    assert "| 50.0 | 2.00x | – | –" in md  # none given (an older report.json)
    assert "skipped 1 malformed line" in md
    events, bad = read_metrics(logs["dpace"])
    assert bad == 1 and len(events) == 7


def test_report_errors_are_one_line(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "metrics.jsonl" in err and "\n" not in err
    with pytest.raises(FileNotFoundError, match="no training log"):
        read_metrics(tmp_path / "missing.jsonl")


def test_commands_end_to_end(tmp_path, capsys) -> None:
    from blockdraft.data.prompt_type import Prompt
    from blockdraft.data.rollouts import generate_rollouts
    from blockdraft.data.rollouts.sampler import SamplingSettings
    from blockdraft.data.rollouts.store import RolloutSet
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.evaluation.offline import offline_stats
    from blockdraft.evaluation.scoring import score_rollout_set
    from blockdraft.serialization.checkpoint import load_drafter, save_drafter
    from blockdraft.targets.registry import load_target
    from random_targets import make_random_target

    src = make_random_target("qwen3")
    tdir = tmp_path / "target"
    src.model.save_pretrained(tdir)
    src.tokenizer.save_pretrained(tdir)
    target = load_target(str(tdir), layer_ids=src.layer_ids)
    prompts = [
        Prompt(id=f"p{i}", text=t, messages=None, source="test")
        for i, t in enumerate(
            [
                "def add(a, b):",
                "for i in range(10):",
                "The quick brown fox",
                "import os",
                "class P:",
            ]
        )
    ]
    rdir = tmp_path / "bench"
    generate_rollouts(
        target,
        prompts,
        rdir,
        SamplingSettings(temperature=1.0, max_new_tokens=12, seed=1),
        progress=False,
    )
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=4)
    a, b = BlockDrafter(cfg).bind_target(target), BlockDrafter(cfg).bind_target(target)
    save_drafter(a, tmp_path / "runA" / "final")
    save_drafter(b, tmp_path / "runB" / "final")
    shutil.copytree(tmp_path / "runA", tmp_path / "runA2")
    _metrics(tmp_path / "runA" / "metrics.jsonl")
    cache = str(tmp_path / "cache")
    common = ["--target", str(tdir), "--cache-dir", cache, "--no-progress", "--rollouts", str(rdir)]

    assert (
        main(
            [
                "eval",
                *common,
                str(tmp_path / "runA"),
                str(tmp_path / "runB"),
                "--json",
                str(tmp_path / "eval.json"),
                "--n-boot",
                "200",
            ]
        )
        == 0
    )
    ev = json.loads((tmp_path / "eval.json").read_text())
    got = {d["name"]: d for d in ev["benchmarks"][0]["drafters"]}
    ref = offline_stats(
        score_rollout_set(
            load_drafter(tmp_path / "runA" / "final", target),
            target,
            RolloutSet.open(rdir),
            use_cache=False,
        )
    )
    assert got["runA"]["mal"] == pytest.approx(ref.mal, rel=1e-6)
    assert got["runA"]["ar_k"] == pytest.approx(ref.ar_k, rel=1e-6)
    assert got["runA"]["mal_ci95"][0] <= got["runA"]["mal"] <= got["runA"]["mal_ci95"][1]

    assert (
        main(
            [
                "compare",
                *common,
                str(tmp_path / "runA"),
                str(tmp_path / "runA2"),
                str(tmp_path / "runB"),
                "--json",
                str(tmp_path / "cmp.json"),
                "--n-boot",
                "200",
            ]
        )
        == 0
    )
    cmp = json.loads((tmp_path / "cmp.json").read_text())["comparisons"]
    assert [(c["a"], c["b"]) for c in cmp] == [("runA", "runA2"), ("runA", "runB")]
    assert cmp[0]["mal_gain"] == 0.0 and cmp[0]["mal_gain_ci95"] == [0.0, 0.0]
    assert cmp[1]["mal_b"] == pytest.approx(got["runB"]["mal"], rel=1e-9)

    assert (
        main(
            [
                "decode",
                "--target",
                str(tdir),
                "--cache-dir",
                cache,
                "--no-progress",
                "--drafter",
                str(tmp_path / "runA"),
                "--rollouts",
                str(rdir),
                "--limit",
                "3",
                "--json",
                str(tmp_path / "dec.json"),
            ]
        )
        == 0
    )
    dec = json.loads((tmp_path / "dec.json").read_text())
    assert dec["settings"]["temperature"] == 1.0 and dec["settings"]["max_new_tokens"] == 12
    assert len(dec["outputs"]) == 3 and dec["speedup"] > 0 and "offline_mal" in dec
    assert (
        main(
            [
                "decode",
                "--target",
                str(tdir),
                "--drafter",
                str(tmp_path / "runA"),
                "--rollouts",
                str(rdir),
                "--temperature",
                "0.5",
            ]
        )
        == 2
    )
    assert "differs from the rollouts" in capsys.readouterr().err

    assert (
        main(
            [
                "report",
                "--eval",
                str(tmp_path / "eval.json"),
                "--compare",
                str(tmp_path / "cmp.json"),
                str(tmp_path / "runA"),  # after a file flag: must stay a run directory
                "--decode",
                str(tmp_path / "dec.json"),
                "--out",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    md = (tmp_path / "report" / "report.md").read_text()
    assert "runA" in md and "![per-position acceptance rates](acceptance_rates.png)" in md
    assert (tmp_path / "report" / "dpace_weight_profile.png").is_file()
    assert main(["eval", *common, str(tmp_path / "nothing")]) == 2


def test_terminal_summary_shows_online_next_to_offline_on_the_same_text() -> None:
    from blockdraft.pipeline.report import terminal_summary

    drafter = {
        "name": "dpace",
        "mal": 3.048,
        "mal_ci95": [2.894, 3.208],
        "tau": 2.965,
        "offline_mal": 2.965,
        "speedup": 1.41,
        "speedup_ci95": [1.204, 1.618],
        "speedup_vs_hf": 1.6,
    }
    old = {**drafter, "name": "old"}  # a report.json written before these fields existed
    for key in ("offline_mal", "speedup_vs_hf", "speedup_ci95"):
        del old[key]
    report = {
        "target": "tiny",
        "block_size": 8,
        "temperature": 0.0,
        "rollouts": {"eval": 64},
        "drafters": [drafter, old],
        "comparisons": [],
    }
    lines = terminal_summary(report).splitlines()
    row = next(line for line in lines if line.startswith("dpace"))
    assert row.split() == [
        "dpace",
        "3.048",
        "[2.894,",
        "3.208]",
        "2.965",
        "(2.965)",
        "1.41x",
        "[1.20,",
        "1.62]",
        "1.60x",
    ]
    old_row = next(line for line in lines if line.startswith("old"))
    assert old_row.split()[-4:] == ["-", "1.41x", "-", "-"]


def test_summary_says_plainly_which_drafters_are_slower_than_hf_generate() -> None:
    from blockdraft.pipeline.report import speed_verdict, terminal_summary

    def row(name, vs_ar, vs_hf):  # type: ignore[no-untyped-def]
        return {"name": name, "mal": 2.0, "mal_ci95": [1.9, 2.1],
                "tau": 2.0, "speedup": vs_ar, "speedup_vs_hf": vs_hf}  # fmt: skip

    drafters = [row("ngram", 1.1, 0.97), row("dpace", 1.4, 1.3)]
    report = {"target": "tiny", "block_size": 8, "temperature": 0.0, "rollouts": {},
              "comparisons": [], "drafters": drafters}  # fmt: skip
    text = terminal_summary(report)
    assert "SLOWER than HF `generate` on this machine: ngram 0.97x (" in text
    assert "Every timed drafter decodes faster than our AR loop (at least 1.10x)." in text
    assert "dpace 1.30x" not in text
    fast = speed_verdict([{"name": "a", "speedup": 1.2, "speedup_vs_hf": 1.5}])
    assert fast[0] == "Every timed drafter decodes faster than HF `generate` (at least 1.50x)."
    assert speed_verdict([{"name": "a", "speedup": None, "speedup_vs_hf": None}]) == []
    # vs our AR loop a slower drafter's CI over prompts is said with it (HF has none)
    slow = speed_verdict([{"name": "b", "speedup": 0.8, "speedup_ci95": [0.7, 0.91],
                           "speedup_vs_hf": 0.9}])  # fmt: skip
    assert slow[0].startswith("SLOWER than HF `generate` on this machine: b 0.90x (")
    assert slow[1].startswith("SLOWER than our AR loop on this machine: b 0.80x [0.70, 0.91] (")
    # a CI that contains 1x is neither slower nor faster, whichever side the ratio is on
    mixed = speed_verdict([
        {"name": "c", "speedup": 0.93, "speedup_ci95": [0.8, 1.1], "speedup_vs_hf": None},
        {"name": "d", "speedup": 1.05, "speedup_ci95": [0.97, 1.2], "speedup_vs_hf": None},
        {"name": "e", "speedup": 1.3, "speedup_ci95": [1.1, 1.5], "speedup_vs_hf": None},
    ])  # fmt: skip
    assert mixed == [
        "Not told apart from our AR loop on these prompts (95% CI over prompts contains 1x): "
        "c 0.93x [0.80, 1.10], d 1.05x [0.97, 1.20]."
    ]
    faster = speed_verdict([{"name": "e", "speedup": 1.3, "speedup_ci95": [1.1, 1.5]}])
    assert faster == ["Every timed drafter decodes faster than our AR loop (at least 1.30x)."]


def test_no_speed_verdict_when_the_machine_was_too_busy() -> None:
    """A loaded machine printed "SLOWER than HF generate" for drafters that are faster:
    rows timed while other processes held the cores (`machine_busy`) get one line saying
    so instead of any verdict."""
    from blockdraft.pipeline.report import speed_verdict

    rows = [
        {"name": "a", "speedup": 0.7, "speedup_ci95": [0.6, 0.8], "speedup_vs_hf": 0.5,
         "machine_busy": True, "other_load_cores": 2.6},
        {"name": "b", "speedup": 5.83, "speedup_ci95": [0.6, 21.88], "speedup_vs_hf": 4.0,
         "machine_busy": False, "other_load_cores": 0.1},
    ]  # fmt: skip
    (line,) = speed_verdict(rows)
    assert line.startswith("No speed verdict: other processes kept 2.6 cores busy while a was")
    assert "SLOWER" not in line and "faster" not in line


def test_report_never_replaces_a_report_without_overwrite(tmp_path, capsys) -> None:
    """`report --out DIR` on a DIR holding a report (its report.md or a plot) is refused
    unless --overwrite: the earlier report is left byte for byte."""
    run = tmp_path / "run"
    run.mkdir()
    _metrics(run / "metrics.jsonl")
    out = tmp_path / "o"
    assert main(["report", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    (out / "report.md").write_text("my notes\n")
    assert main(["report", str(run), "--out", str(out), "--title", "again"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "report.md" in err and "--overwrite" in err
    assert "\n" not in err and (out / "report.md").read_text() == "my notes\n"
    (out / "report.md").unlink()  # a plot alone counts as a report too
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert "training_curves.png" in capsys.readouterr().err
    assert main(["report", str(run), "--out", str(out), "--overwrite", "--title", "T2"]) == 0
    assert (out / "report.md").read_text().startswith("# T2")


@pytest.mark.parametrize(
    ("flag", "content", "says"),
    [
        (
            "--eval",
            {"comparisons": []},
            "it is a `blockdraft compare --json` file: pass it with --compare",
        ),
        ("--eval", [1, 2], "not a `blockdraft eval --json` file"),
        ("--compare", {"target": "t", "benchmarks": []}, "pass it with --eval"),
        ("--decode", {"target": "t", "benchmarks": []}, "pass it with --eval"),
        ("--decode", {"a": 1}, "not a `blockdraft decode --json` file"),
    ],
)
def test_report_names_a_results_file_of_the_wrong_kind(tmp_path, capsys, flag, content, says):
    """A results file given under the wrong flag is neither skipped in silence nor drawn
    as junk: one line names the file and the flag it belongs to."""
    f = tmp_path / "results.json"
    f.write_text(json.dumps(content))
    assert main(["report", flag, str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and str(f) in err and says in err, err
    assert not (tmp_path / "o" / "report.md").exists()
