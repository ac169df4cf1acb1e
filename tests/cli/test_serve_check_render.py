"""`serve-check`'s printed verdicts say what its JSON says (no vLLM needed: `render` is
a function of the result)."""

from __future__ import annotations

from blockdraft.cli.serve_check import render


def _result(exact: bool) -> dict:
    row = {
        "outputs_equal_rollouts": 2, "rounds": 10, "served_tau": 1.5,
        "vllm_mean_acceptance_length": 1.5, "tokens_per_s_batch1": 10.0,
        "tokens_per_s_batch8": 20.0,
    }  # fmt: skip
    off = {"expected_rounds": 10.0, "mal": 1.5, "mal_ci95": [1.4, 1.6]}
    agree = {
        "exact": exact, "rounds_compared_on": 2, "rounds_differ_on": [] if exact else [1],
        "offline_mal": 1.5, "served_tau": 1.5,
    }  # fmt: skip
    return {
        "drafter": "d", "target": "tiny", "engine": "vllm", "batch_size": 8,
        "benchmarks": [{
            "name": "b", "num_prompts": 2, "settings": {"temperature": 0.0},
            "served": {"ngram": row}, "offline": {"ngram": off}, "agreement": {"ngram": agree},
        }],
    }  # fmt: skip


def test_the_ngram_verdict_follows_the_agreement_it_prints_beside():
    same = render(_result(exact=True)).splitlines()[-1]
    assert same.startswith("- ngram: rounds equal the offline evaluator's on every prompt")
    assert "not expected to be equal" not in same
    differ = render(_result(exact=False)).splitlines()[-1]
    assert differ.startswith("- ngram: rounds differ on prompts [1]")


def test_an_output_that_differs_is_named_not_reported_as_a_round_difference():
    """Rounds equal on every comparable prompt, one output unlike its rollout: the verdict
    says how many were compared and that one differs, never "rounds differ on []"."""
    result = _result(exact=False)
    bench = result["benchmarks"][0]
    bench["agreement"]["ngram"].update(rounds_differ_on=[], rounds_compared_on=1)
    bench["served"]["ngram"]["outputs_equal"] = [True, False]
    line = render(result).splitlines()[-1]
    assert line.startswith("- ngram: rounds equal the offline evaluator's on the 1 prompt(s)")
    assert "(1 differs" in line and "[]" not in line


def test_an_engines_own_lookup_rule_is_reported_not_judged():
    result = _result(exact=True)
    bench = result["benchmarks"][0]
    bench["agreement"], bench["engine_rules"] = {}, ["ngram"]
    result["engine"] = "llamacpp 0.3"
    line = render(result).splitlines()[-1]
    assert line.startswith("- ngram: llamacpp's own rule, not blockdraft's")
    assert "rounds equal" not in line and "rounds differ" not in line
