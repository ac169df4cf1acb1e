"""llama.cpp serves what blockdraft exports, and agrees with the offline evaluator round for
round (`make test-llamacpp`; skipped unless `make engine-llamacpp` built llama-server).

At temperature 0 with an f32 target GGUF a lossless engine returns the rollouts themselves,
and on the same text the evaluator's rounds are exact integers: llama.cpp's verification
rounds per request must equal them (so served tau = offline MAL). The drafter is trained
briefly on the full vocabulary (llama.cpp's DFlash converter writes no `d2t`), so llama.cpp
accepts some of its proposals and rejects others (checked: the comparison cannot pass
vacuously).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import urllib.request

import pytest
from enginekit import train_tiny_drafter

from blockdraft.cli import main
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.engines.llamacpp_gguf import server_binary
from blockdraft.serving.serve_check import serve_check

pytestmark = [
    pytest.mark.skipif(
        server_binary() is None,
        reason="llama.cpp's llama-server is not built (`make engine-llamacpp` builds it)",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def full_vocab_drafter(tiny, tiny_sets, tmp_path_factory):
    run = tmp_path_factory.mktemp("llamacpp-drafter") / "run"
    return train_tiny_drafter(tiny, tiny_sets["train"], run, draft_vocab_size=None)


@pytest.fixture(scope="module")
def checked(tiny, full_vocab_drafter, tiny_sets):
    return serve_check(
        tiny,
        full_vocab_drafter,
        [tiny_sets["eval"]],
        ways=("dflash", "none"),
        batch_size=4,
        log=lambda m: None,
        engine="llamacpp",
    )


def test_served_lossless_and_rounds_equal_the_offline_evaluator(checked):
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    n = bench["num_prompts"]
    assert served["outputs_equal_rollouts"] == n  # lossless on every prompt
    assert bench["served"]["none"]["outputs_equal_rollouts"] == n
    assert served["per_request_rounds"] == [round(r) for r in offline["per_rollout_rounds"]]
    assert bench["agreement"]["dflash"]["exact"], bench["agreement"]["dflash"]
    assert served["served_tau"] == pytest.approx(offline["mal"], rel=1e-12)
    # not vacuous: some proposals accepted and some rejected
    assert 0 < served["accepted"] < served["drafts"] * 7
    assert 1.0 < offline["mal"] < 8.0


def test_accepted_per_position_is_the_evaluators(checked):
    """Beyond position 1 llama.cpp accepts exactly the evaluator's T_{>=k}; at position 1
    it may accept fewer, at most one per response: it drafts no further than the response's
    budget, so its last step can draft nothing where the evaluator scores a last round
    (measured on tiny: one token in 8 prompts, rounds and tau still equal)."""
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    past = bench["agreement"]["dflash"]["accepted_past_end_per_position"]
    assert all(x <= 0 for x in past[1:]) and -bench["num_prompts"] <= past[0] <= 0
    assert [v - p for v, p in zip(served["accepted_per_position"], past, strict=True)] == (
        pytest.approx(offline["t_ge_k"])
    )


def test_export_gguf_prints_a_command_that_serves_the_drafter(
    tiny, full_vocab_drafter, tiny_sets, tmp_path, capsys
):
    out = tmp_path / "gguf"
    code = main(
        ["export", str(full_vocab_drafter), "--out", str(out), "--format", "gguf",
         "--target", "tiny"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (out / "drafter.gguf").is_file()
    commands = [line for line in printed.splitlines() if line.startswith("llama-server ")]
    assert "TARGET.gguf" in commands[0]  # the generic line, before the GGUFs exist
    command = commands[-1]  # the one naming the GGUFs just written
    argv = shlex.split(command)
    assert argv[argv.index("-md") + 1] == str((out / "drafter.gguf").resolve())
    port = 18000 + (hash(str(tmp_path)) % 1000)
    argv = [str(server_binary()), *argv[1:], "--port", str(port), "-t", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        row = next(iter(RolloutSet.open(tiny_sets["eval"])))
        body = {"prompt": row.prompt_ids.tolist(), "n_predict": 16, "temperature": 0,
                "return_tokens": True, "cache_prompt": False}  # fmt: skip
        req = urllib.request.Request(
            url + "/completion", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            reply = json.loads(r.read())
        assert reply["tokens"] == row.response_ids.tolist()[:16]  # the rollout, greedily
        assert reply["timings"]["draft_n"] > 0  # and the drafter drafted
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_check_cli_prints_the_table(full_vocab_drafter, tiny_sets, tmp_path, capsys):
    out = tmp_path / "sc.json"
    code = main(
        ["serve-check", "--engine", "llamacpp", "--target", "tiny", "--rollouts",
         str(tiny_sets["eval"]), str(full_vocab_drafter), "--ways", "dflash,ngram", "--limit", "3",
         "--json", str(out), "--no-progress"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "| dflash | 3/3 |" in printed
    assert "- dflash: rounds equal the offline evaluator's on every prompt" in printed
    # llama.cpp's n-gram is its own rule: reported, never judged against blockdraft's
    assert "- ngram: llamacpp's own rule, not blockdraft's" in printed
    assert "rounds differ" not in printed
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert bench["agreement"]["dflash"]["exact"] is True
    assert "ngram" not in bench["agreement"] and bench["engine_rules"] == ["ngram"]
