"""vLLM serves what blockdraft exports, and agrees with the offline evaluator round for round.

At temperature 0 a lossless engine must return the rollouts themselves, and on the same
text the evaluator's rounds are exact integers: vLLM's drafts per request must equal them
(so served tau = offline MAL), whatever the drafter's quality. The drafter here is trained
briefly on a reduced draft vocabulary, so it is served through `d2t` and accepts some
proposals and rejects others (checked, so the comparison cannot pass vacuously).
"""

from __future__ import annotations

import json

import pytest
from enginekit import needs_vllm

from blockdraft.cli import main
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.serving.serve_check import serve_check

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checked(tiny, tiny_drafter, tiny_sets):
    return serve_check(tiny, tiny_drafter, [tiny_sets["eval"]], batch_size=4, log=lambda m: None)


def test_served_lossless_and_rounds_equal_the_offline_evaluator(checked):
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    n = bench["num_prompts"]
    assert served["outputs_equal_rollouts"] == n  # lossless on every prompt
    assert bench["served"]["none"]["outputs_equal_rollouts"] == n
    assert bench["agreement"]["dflash"]["exact"], bench["agreement"]["dflash"]
    assert served["per_request_rounds"] == [round(r) for r in offline["per_rollout_rounds"]]
    assert served["served_tau"] == pytest.approx(offline["mal"], rel=1e-12)
    # not vacuous: some proposals accepted and some rejected
    assert 0 < served["accepted"] < served["drafts"] * 7
    assert 1.0 < offline["mal"] < 8.0


def test_vllms_prompt_lookup_takes_the_evaluators_ngram_rounds(checked):
    """blockdraft's default `ngram` is vLLM's rule, so its offline rounds are what vLLM's
    own prompt lookup does on the same text, request for request."""
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["ngram"], bench["offline"]["ngram"]
    assert served["outputs_equal_rollouts"] == bench["num_prompts"]
    assert bench["agreement"]["ngram"]["exact"], bench["agreement"]["ngram"]
    assert served["served_tau"] == pytest.approx(offline["mal"], rel=1e-12)
    assert served["accepted"] > 0  # lookup found matches: not vacuous


def test_accepted_per_position_differs_only_past_the_end_of_responses(checked):
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    past = bench["agreement"]["dflash"]["accepted_past_end_per_position"]
    assert all(x >= 0 for x in past)  # vLLM never accepts less than the evaluator expects
    # what vLLM counts beyond the evaluator is bounded by one truncated round per response
    assert sum(past) <= 7 * bench["num_prompts"]
    assert [v - p for v, p in zip(served["accepted_per_position"], past, strict=True)] == (
        pytest.approx(offline["t_ge_k"])
    )


def test_serve_check_cli_prints_the_table_and_writes_json(
    tiny_drafter, tiny_sets, tmp_path, capsys
):
    out = tmp_path / "sc.json"
    code = main(
        ["serve-check", "--target", "tiny", "--rollouts", str(tiny_sets["eval"]),
         str(tiny_drafter), "--ways", "dflash", "--limit", "3", "--json", str(out),
         "--no-progress"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "| dflash | 3/3 |" in printed
    assert "rounds equal the offline evaluator's on every prompt" in printed
    result = json.loads(out.read_text())
    assert result["benchmarks"][0]["agreement"]["dflash"]["exact"] is True


def test_rollout_engine_vllm_writes_the_built_in_rollouts(tiny_sets, tmp_path, capsys):
    out = tmp_path / "vllm"
    code = main(
        ["rollout", "--target", "tiny", "--prompts", "stdlib:eval", "--limit", "8",
         "--temperature", "0", "--max-new-tokens", "48", "--engine", "vllm", "--out", str(out),
         "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    ours, theirs = RolloutSet.open(tiny_sets["eval"]), RolloutSet.open(out)
    assert theirs.manifest["engine"].startswith("vllm ")
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_id == b.prompt_id and a.response_ids.tolist() == b.response_ids.tolist()
        assert (a.logprobs - b.logprobs).abs().max() < 1e-3  # the same T = 1 log-softmax


def test_sampled_engine_rollouts_store_their_distribution_and_resume(tmp_path, capsys):
    out = tmp_path / "t07"
    args = ["rollout", "--target", "tiny", "--prompts", "stdlib:eval", "--temperature", "0.7",
            "--top-k", "20", "--max-new-tokens", "24", "--engine", "vllm", "--out", str(out),
            "--shard-size", "2", "--no-progress"]  # fmt: skip
    assert main([*args, "--limit", "2"]) == 0
    assert main([*args, "--limit", "4"]) == 0  # extends the set: resumes after 2 rows
    assert "resuming: 2 of 4" in capsys.readouterr().out
    rows = list(RolloutSet.open(out))
    assert len(rows) == 4 and RolloutSet.open(out).manifest["store_topk"] == 20
    for row in rows:
        mass = row.topk_logprobs.exp().sum(-1)
        assert mass.sub(1).abs().max() < 1e-3  # top-k 20 of a top-k-20 distribution: all of it
        hit = row.topk_ids == row.response_ids[:, None]
        assert bool(hit.any(-1).all())  # the sampled token is among the stored ones
        at = row.topk_logprobs[hit]
        assert (at - row.logprobs).abs().max() < 1e-4  # and its log-prob is the stored one


def test_rounds_trace_follows_vllm_round_by_round(tiny, tiny_drafter, tiny_sets):
    from blockdraft.serving.serve_check import rounds_trace

    trace = rounds_trace(tiny, tiny_drafter, tiny_sets["eval"], 1)
    assert trace["output_equals_rollout"] and trace["first_difference"] is None
    rounds = trace["rounds"]
    assert all(r["anchor_is_rollout_token"] for r in rounds)
    # the rounds tile the response: each starts right after the last one's accepted tokens
    for a, b in zip(rounds, rounds[1:], strict=False):
        assert b["start"] == a["start"] + a["served_accepted"] + 1
    assert sum(r["served_accepted"] for r in rounds) > 0


def test_the_demo_adds_a_vllm_row(tiny, tiny_drafter, tiny_sets, tmp_path):
    from blockdraft.pipeline.demo import DemoSettings, served_in_vllm, served_summary

    s = DemoSettings(out=str(tmp_path), online_prompts=4)
    served = served_in_vllm(tiny, s, {"edr": tiny_drafter}, {"eval": tiny_sets["eval"]}, tmp_path)
    assert served is not None and served["outputs_equal_rollouts"] == 4
    assert served["rounds_equal_offline"] and served["served_tau"] == served["offline_mal"]
    line = served_summary(served)
    assert "outputs equal the rollouts 4/4" in line and "batch4" in line
    # a second run reuses the stage
    assert served_in_vllm(tiny, s, {"edr": tiny_drafter}, {"eval": tiny_sets["eval"]}, tmp_path)
