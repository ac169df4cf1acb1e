"""`blockdraft demo` end to end on a small random target saved as a local HF directory:
every stage runs, report.json has the documented shape, and a second run reuses every
stage instead of recomputing it, even with the directory moved and given as a relative path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from blockdraft.cli import main
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.pipeline.demo import DemoSettings
from random_targets import make_random_target

SMALL = [
    "--num-train-prompts",
    "12",
    "--num-eval-prompts",
    "6",
    "--max-new-tokens",
    "16",
    "--online-prompts",
    "2",
    "--online-max-new-tokens",
    "12",
    "--epochs",
    "1",
    "--batch-size",
    "4",
    "--num-anchors",
    "8",
]


@pytest.mark.slow
def test_demo_runs_end_to_end_and_reuses_stages(tmp_path, capsys, monkeypatch):
    target = make_random_target("qwen3", num_layers=4)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "demo"
    common = [
        "--target",
        str(tmp_path / "target"),
        *SMALL,
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    assert main(["demo", "--out", str(out), *common]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["block_size"] == 8 and report["temperature"] == DemoSettings().temperature
    assert report["rollouts"] == {"train": 12, "eval": 6}
    names = [d["name"] for d in report["drafters"]]
    # the free drafters first: prompt lookup, then suffix decoding
    assert names == ["ngram", "suffix", "decay", "dpace", "dpace-ft", "e2e", "edr"]
    objectives = {d["name"]: d["objective"] for d in report["drafters"]}
    assert objectives["ngram"] == objectives["suffix"] == "none"
    assert objectives["dpace"] == "dpace"
    assert objectives["dpace-ft"] == "dpace"  # the fine-tunes' control
    for d in report["drafters"]:
        lo, hi = d["mal_ci95"]
        assert 1.0 <= lo <= d["mal"] <= hi <= 8.0
        if d["name"] == "dpace-ft":  # compared offline only
            assert d["tau"] is None
            continue
        assert len(d["ar_k"]) == 7 and d["tau"] >= 1.0 and d["speedup"] > 0
        assert d["speedup_vs_hf"] > 0
        # greedy online decoding re-emits the rollouts' text: tau is the offline MAL of
        # the same prompts at the same length, exactly
        assert d["tau"] == pytest.approx(d["offline_mal"], abs=1e-9)
    pairs = [(c["a"], c["b"]) for c in report["comparisons"]]
    assert ("decay", "dpace") in pairs and ("e2e", "edr") in pairs and ("ngram", "dpace") in pairs
    assert ("suffix", "edr") in pairs
    # every fine-tune against its start and against the continued-D-PACE control
    for ft in ("e2e", "edr"):
        assert ("dpace", ft) in pairs and ("dpace-ft", ft) in pairs
    assert ("dpace", "dpace-ft") in pairs
    md = (out / "report" / "report.md").read_text()
    assert "HF `generate`: " in md and "| vs HF generate |" in md
    # where each drafter wins and loses against prompt lookup, every drafter in every group
    split = report["baseline_split"]
    assert sum(g["share"] for g in split["groups"]) == pytest.approx(1.0)
    assert all(list(g["mean_accepted"]) == names for g in split["groups"])
    assert set(split["oracle_mal"]) == set(names[1:])
    assert "## Where the drafters win and lose against `ngram`" in md
    # the drafters score a reduced vocabulary: the training responses' distinct tokens,
    # rounded up to a power of two (smaller than the random target's vocabulary here)
    train_set = RolloutSet.open(out / "rollouts" / "train" / "set")
    distinct = len({t for r in train_set for t in r.response_ids.tolist()})
    size = report["draft_vocab_size"]
    assert size >= distinct and size // 2 < distinct and size & (size - 1) == 0
    assert size < target.vocab_size
    for name in ("decay", "dpace", "edr"):
        cfg = json.loads((out / "runs" / name / "final" / "config.json").read_text())
        assert cfg["blockdraft"]["drafter_config"]["draft_vocab_size"] == size
    first = capsys.readouterr().out
    assert f"draft_vocab={size}" in first

    out.rename(tmp_path / "moved")  # stage keys must not depend on where `out` is
    out = tmp_path / "moved"
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--out", "moved", *common]) == 0
    second = capsys.readouterr().out
    assert "generating" in first and "generating" not in second
    for stage in ("rollouts/train", "rollouts/eval", "train decay", "train edr", "online"):
        assert f"{stage}: reused" in second or f"{stage} decoding: reused" in second
    assert json.loads((out / "report.json").read_text())["drafters"] == report["drafters"]


def test_draft_vocab_falls_back_to_the_whole_vocabulary_or_takes_the_setting(tmp_path):
    """Rollouts whose responses use as many distinct tokens as the vocabulary has, rounded
    up, get the whole vocabulary (None); an explicit size is taken as given."""
    from blockdraft.data.prompt_type import Prompt
    from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
    from blockdraft.pipeline.demo import draft_vocab_for

    target = make_random_target("qwen3", num_layers=1)
    prompts = [Prompt(id=f"p{i}", text=f"x{i}", messages=None, source="t") for i in range(8)]
    sampled = SamplingSettings(temperature=1.0, max_new_tokens=64, seed=0)
    generate_rollouts(target, prompts, tmp_path / "r", sampled, batch_size=8, progress=False)
    seen = {t for r in RolloutSet.open(tmp_path / "r") for t in r.response_ids.tolist()}
    size = 1 << (len(seen) - 1).bit_length()
    expected = size if size < target.vocab_size else None
    assert draft_vocab_for(DemoSettings(), target, tmp_path / "r") == expected
    for vocab in (size, size // 2):  # a vocabulary the rounded size reaches: the whole one
        assert (
            draft_vocab_for(DemoSettings(), SimpleNamespace(vocab_size=vocab), tmp_path / "r")
            is None
        )
    assert draft_vocab_for(DemoSettings(draft_vocab_size=64), target, tmp_path / "r") == 64
