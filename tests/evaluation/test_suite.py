"""`blockdraft suite`: suite files, prompt selection, the baseline, and a run end to end on a
small random local target (rollouts generated once and cached; per-benchmark numbers equal
`blockdraft eval` on the same rollouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockdraft.data.rollouts import RolloutSet, generate_rollouts
from blockdraft.data.rollouts.store import read_manifest
from blockdraft.evaluation.suite import (
    Suite,
    SuiteError,
    benchmark_arg,
    benchmark_rollouts,
    load_suite,
    select_prompts,
    with_baseline,
)
from blockdraft.serialization.drafter_spec import DrafterSpec
from clikit import one_line_error, run_cli, save_local_model, save_random_drafter

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_shipped_suites_parse_and_name_their_benchmarks(tmp_path, monkeypatch):
    gemma = load_suite(REPO / "configs/suites/gemma-3-270m.yaml", data_dir="/data")
    assert [b.name for b in gemma.benchmarks] == ["gsm8k", "humaneval", "mt-bench"]
    assert gemma.benchmarks[0].prompts == "/data/gsm8k/test.jsonl:question"
    assert gemma.sampling.temperature == 0 and gemma.sampling.max_new_tokens == 128
    shipped = load_suite(REPO / "configs/suites/gemma-3-270m.yaml")  # relative to the file
    assert (
        shipped.benchmarks[0].prompts
        == str((REPO / "configs/suites/../../../shared/data").resolve() / "gsm8k/test.jsonl")
        + ":question"
    )
    monkeypatch.chdir(tmp_path)  # --data-dir is relative to where it was typed
    typed = load_suite(REPO / "configs/suites/gemma-3-270m.yaml", data_dir="data")
    assert typed.benchmarks[0].prompts == f"{tmp_path / 'data'}/gsm8k/test.jsonl:question"
    tiny = load_suite(REPO / "configs/suites/tiny.yaml")
    assert tiny.benchmarks[0].prompts == "stdlib:eval"
    sampled = load_suite(REPO / "configs/suites/gemma-3-270m-t1.yaml", data_dir="/data")
    assert sampled.benchmarks == gemma.benchmarks  # the same prompts, sampled at T = 1
    assert sampled.sampling.temperature == 1 and sampled.name != gemma.name
    paper = load_suite(REPO / "configs/suites/gemma-3-270m-t07.yaml", data_dir="/data")
    assert paper.benchmarks == gemma.benchmarks  # the paper's other setting, same prompts
    s = paper.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.8, 20) and paper.name != sampled.name


@pytest.mark.parametrize(
    "body, key",
    [
        ("benchmarks: []\n", "benchmarks"),
        ("benchmarkz: [{name: a, prompts: x}]\n", "benchmarkz"),
        ("benchmarks: [{name: a, prompts: x, limit: 0}]\n", "benchmarks[0].limit"),
        ("benchmarks: [{name: a, prompts: x, select: random}]\n", "benchmarks[0].select"),
        ("benchmarks: [{name: a, prompts: x}, {name: a, prompts: y}]\n", "'a' is used twice"),
        ("benchmarks: [{name: a, prompts: '{data_dir}/x.jsonl'}]\n", "{data_dir}"),
        ("rollouts: {temperature: -1}\nbenchmarks: [{name: a, prompts: x}]\n", "temperature"),
        ("rollouts: {beams: 2}\nbenchmarks: [{name: a, prompts: x}]\n", "beams"),
        ("benchmarks: [{name: a, prompts: x}\n", "line"),
    ],
)
def test_bad_suite_files_name_file_and_key(tmp_path, body, key):
    path = _write(tmp_path / "s.yaml", body)
    with pytest.raises(SuiteError) as exc:
        load_suite(path)
    msg = str(exc.value)
    assert str(path) in msg and key in msg and "\n" not in msg


def test_benchmark_argument():
    assert benchmark_arg("code=my.jsonl:prompt").prompts == "my.jsonl:prompt"
    for bad in ("code", "=x.jsonl", "a b=x.jsonl", "code="):
        with pytest.raises(SuiteError, match="NAME=PROMPT_SPEC"):
            benchmark_arg(bad)


def test_spread_selection_covers_the_whole_file():
    items = list(range(80))
    assert select_prompts(items, 8, "first") == list(range(8))
    spread = select_prompts(items, 8, "spread")
    assert spread == [0, 10, 20, 30, 40, 50, 60, 70]
    assert select_prompts(items, 100, "spread") == items
    assert len(set(select_prompts(items, 79, "spread"))) == 79


def test_ngram_baseline_matches_the_drafters_block(tmp_path):
    from random_targets import make_random_target

    target = make_random_target("qwen3", num_layers=2, seed=0)
    d5 = save_random_drafter(target, tmp_path / "d5", block_size=5)
    d8 = save_random_drafter(target, tmp_path / "d8", block_size=8)
    suite = Suite("s", [])

    def baseline_first(suite: Suite, *drafters: object) -> list[str]:
        return [str(d) for d in with_baseline(suite, [DrafterSpec.parse(d) for d in drafters])]

    assert baseline_first(suite, d5) == ["ngram:k=4,max=3,min=1", str(d5)]
    assert baseline_first(suite, d8, "ngram") == ["ngram", str(d8)]  # K = 7 is the default
    assert baseline_first(suite, d5, d8)[0] == "ngram"  # no common K: the default
    explicit = Suite("s", [], baseline=DrafterSpec.parse("ngram:k=2"))
    assert baseline_first(explicit, d5, "ngram:k=2") == ["ngram:k=2", str(d5)]
    # references come right after the baseline, a bare one at the drafters' K too
    refs = Suite("s", [], references=(DrafterSpec.parse("suffix"),))
    assert baseline_first(refs, d5, "suffix") == ["ngram:k=4,max=3,min=1", "suffix:k=4", str(d5)]
    assert baseline_first(refs, d5, d8) == ["ngram", "suffix", str(d5), str(d8)]


def test_suite_references_parse_and_reject(tmp_path):
    text = "benchmarks: [{name: a, prompts: stdlib:eval}]\n"
    _write(tmp_path / "ok.yaml", text + "references: [suffix, 'ngram:k=3']\n")
    assert [str(r) for r in load_suite(tmp_path / "ok.yaml").references] == ["suffix", "ngram:k=3"]
    assert load_suite(tmp_path / "ok.yaml").references[0].kind == "suffix"
    for bad, says in (("references: suffix", "a list"), ("references: ['suffix:x=1']", "x=1")):
        _write(tmp_path / "bad.yaml", text + bad + "\n")
        with pytest.raises(SuiteError, match=f"references: .*{says}"):
            load_suite(tmp_path / "bad.yaml")


@pytest.mark.slow
def test_suite_end_to_end_caches_rollouts_and_agrees_with_eval(tmp_path, capsys):
    from blockdraft.targets.registry import load_target

    model = save_local_model(tmp_path / "model")
    target = load_target(str(model), device="cpu", progress=False)
    drafter = save_random_drafter(target, tmp_path / "drafter", block_size=4)
    lines = [json.dumps({"id": f"q{i}", "prompt": f"# {i}\ndef f{i}(x):"}) for i in range(6)]
    _write(tmp_path / "code.jsonl", "\n".join(lines) + "\n")
    chat = [json.dumps({"question_id": i, "turns": [f"Say {i} twice.", "again"]}) for i in range(5)]
    _write(tmp_path / "chat.jsonl", "\n".join(chat) + "\n")
    suite = _write(
        tmp_path / "suite.yaml",
        "name: small\ndata_dir: .\nrollouts: {temperature: 0, max_new_tokens: 12, batch_size: 4}\n"
        "benchmarks:\n  - {name: code, prompts: '{data_dir}/code.jsonl:prompt'}\n"
        "  - {name: chat, prompts: '{data_dir}/chat.jsonl:turns', limit: 4, select: spread}\n",
    )
    args = [
        "suite", "--target", model, "--suite", suite, "--rollouts-dir", tmp_path / "sets",
        "--cache-dir", tmp_path / "cache", "--no-progress", "--n-boot", "200",
        "--json", tmp_path / "suite.json", "--plot", tmp_path / "suite.png", drafter,
    ]  # fmt: skip
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert out.count("generating rollouts") == 2
    assert "| ngram:k=3,max=3,min=1 |" in out and "| drafter |" in out
    assert (tmp_path / "suite.png").stat().st_size > 0
    result = json.loads((tmp_path / "suite.json").read_text())
    assert [b["name"] for b in result["benchmarks"]] == ["code", "chat"]
    assert [b["num_rollouts"] for b in result["benchmarks"]] == [6, 4]
    for bench in result["benchmarks"]:  # greedy sets: scored greedily only, no log-probs
        assert read_manifest(Path(bench["rollouts"]))["store_logprobs"] is False
    assert [d["name"] for d in result["mean"]] == ["ngram:k=3,max=3,min=1", "drafter"]
    # a second run reuses the rollouts and prints the same table (--overwrite: its --json
    # and --plot files exist now, which is refused without it)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "suite.png: file exists" in err
    args.append("--overwrite")
    code, out2, err = run_cli(capsys, *args)
    assert code == 0 and "generating rollouts" not in out2 and out2.count("(cached)") == 2
    table = out.split("Exact offline MAL", 1)[1]
    assert out2.split("Exact offline MAL", 1)[1] == table
    # per-benchmark numbers are those of `blockdraft eval` on the same rollouts
    for bench in result["benchmarks"]:
        code, _, err = run_cli(
            capsys, "eval", "--target", model, "--rollouts", bench["rollouts"], "--no-progress",
            "--cache-dir", tmp_path / "cache", "--n-boot", "200", "--json",
            tmp_path / "eval.json", "--overwrite", "ngram:k=3", drafter,
        )  # fmt: skip
        assert code == 0, err
        ev = json.loads((tmp_path / "eval.json").read_text())["benchmarks"][0]["drafters"]
        for mine, theirs in zip(bench["drafters"], ev, strict=True):
            assert mine["mal"] == pytest.approx(theirs["mal"], rel=1e-12)
            assert mine["mal_ci95"] == pytest.approx(theirs["mal_ci95"], rel=1e-12)
    mean = result["mean"][1]["mal"]
    per = [b["drafters"][1]["mal"] for b in result["benchmarks"]]
    assert mean == pytest.approx(sum(per) / 2, rel=1e-12)
    # --split: where the drafter wins and loses against the baseline, per benchmark
    code, out3, err = run_cli(capsys, *args, "--split")
    assert code == 0, err
    assert out3.count("round starts, grouped by") == 2
    split = json.loads((tmp_path / "suite.json").read_text())["benchmarks"][0]["baseline_split"]
    assert sum(g["share"] for g in split["groups"]) == pytest.approx(1.0)
    for g in split["groups"]:  # the baseline's own mean is pinned by its group
        lookup = g["mean_accepted"]["ngram:k=3,max=3,min=1"]
        if g["baseline_accepts"] in ("0", "3"):
            assert lookup == float(g["baseline_accepts"])


def test_an_interrupted_suite_set_resumes_as_it_was_started(tmp_path):
    """A greedy set begun with log-probs (before sets left them out) is finished with them,
    not refused as a mix; a new greedy set has none."""
    from blockdraft.data.prompt_specs import load_prompts
    from blockdraft.targets.registry import load_target

    target = load_target(str(save_local_model(tmp_path / "model")), device="cpu", progress=False)
    lines = [json.dumps({"id": f"q{i}", "prompt": f"def f{i}(x):"}) for i in range(5)]
    _write(tmp_path / "code.jsonl", "\n".join(lines) + "\n")
    suite = load_suite(
        _write(
            tmp_path / "suite.yaml",
            "name: s\ndata_dir: .\nrollouts: {temperature: 0, max_new_tokens: 6}\n"
            "benchmarks:\n  - {name: code, prompts: '{data_dir}/code.jsonl:prompt'}\n",
        )
    )
    first = benchmark_rollouts(target, suite, tmp_path / "sets", progress=False)["code"]
    assert read_manifest(first)["store_logprobs"] is False
    fresh = {r.prompt_id: r.response_ids.tolist() for r in RolloutSet.open(first)}
    for f in first.iterdir():
        f.unlink()
    prompts = load_prompts(str(tmp_path / "code.jsonl") + ":prompt")
    generate_rollouts(target, prompts[:2], first, suite.sampling, progress=False)  # old kind
    again = benchmark_rollouts(target, suite, tmp_path / "sets", progress=False)["code"]
    assert again == first and "store_logprobs" not in read_manifest(first)
    done = RolloutSet.open(first)
    assert len(done) == 5 and all(torch.isfinite(r.logprobs).all() for r in done)
    assert {r.prompt_id: r.response_ids.tolist() for r in done} == fresh


def test_suite_cli_errors_are_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "suite", "--target", "tiny", "ngram")
    assert code == 2 and "--suite" in one_line_error(err)
    bad = _write(tmp_path / "s.yaml", "benchmarks: [{name: a}]\n")
    code, _, err = run_cli(capsys, "suite", "--target", "tiny", "--suite", bad)
    assert code == 2 and "benchmarks[0].prompts" in one_line_error(err)
    code, _, err = run_cli(
        capsys, "suite", "--target", "tiny", "--benchmark", "a=x.jsonl", tmp_path / "missing"
    )
    assert code == 2 and "missing" in one_line_error(err)
