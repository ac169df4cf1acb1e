"""Lookup-aware drafters served by vLLM through blockdraft's plugin, round for round.

A `lookup_inputs` drafter's slots read prompt lookup's tokens and a `hybrid` spec gives
low-confidence slots the looked-up token; at T = 0 vLLM must return the rollouts and take
the evaluator's exact rounds on every prompt, whatever the drafter's quality. Each check
also shows that the lookups changed the rounds (the same weights without them take other
rounds), so equality cannot come from a plugin that ignores them. Without the plugin vLLM
must refuse the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from enginekit import needs_vllm

from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollout_set
from blockdraft.serialization.checkpoint import load_drafter, save_drafter
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.serialization.export import export_drafter
from blockdraft.serving.serve_check import serve_check
from blockdraft.targets.registry import model_directory

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def lookup_drafter(tiny, tmp_path_factory):
    """A random 1-layer `lookup_inputs` drafter: its block attends to the looked-up
    tokens' embeddings, which the target's tied head scores highest, so it proposes
    lookup's tokens where lookup has some, and its own where not."""
    torch.manual_seed(0)
    config = DrafterConfig.for_target(tiny, num_layers=1, block_size=8, lookup_inputs=True)
    drafter = BlockDrafter(config).bind_target(tiny)
    return save_drafter(drafter, tmp_path_factory.mktemp("lookup-drafter") / "ckpt")


def _offline_rounds(tiny, spec, rollouts):
    drafter, _ = load_drafter_spec(spec, tiny)
    acc = score_rollout_set(drafter, tiny, rollouts, use_cache=False, progress=False)
    return [round(r) for r in offline_stats(acc).per_rollout_rounds.tolist()]


def _assert_served_exactly(checked):
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    n = bench["num_prompts"]
    assert served["outputs_equal_rollouts"] == n  # lossless on every prompt
    assert served["batched_outputs_equal_batch1"] == n  # and four requests at a time
    assert bench["agreement"]["dflash"]["exact"], bench["agreement"]["dflash"]
    assert served["per_request_rounds"] == [round(r) for r in offline["per_rollout_rounds"]]
    assert served["served_tau"] == pytest.approx(offline["mal"], rel=1e-12)
    return served["per_request_rounds"]


def test_lookup_inputs_drafter_takes_the_evaluators_rounds(tiny, tiny_sets, lookup_drafter):
    checked = serve_check(
        tiny, lookup_drafter, [tiny_sets["eval"]], ways=("dflash",), batch_size=4,
        log=lambda m: None,
    )  # fmt: skip
    rounds = _assert_served_exactly(checked)
    # the same weights reading MASK in their slots take more rounds: the lookup mattered
    masked = load_drafter(lookup_drafter, tiny)
    config = DrafterConfig.from_dict({**masked.config.to_dict(), "lookup_inputs": False})
    plain = BlockDrafter(config)
    plain.load_state_dict(masked.state_dict())
    plain.bind_target(tiny).eval()
    rollouts = RolloutSet.open(tiny_sets["eval"])
    acc = score_rollout_set(plain, tiny, rollouts, use_cache=False, progress=False)
    without = [round(r) for r in offline_stats(acc).per_rollout_rounds.tolist()]
    assert sum(rounds) < sum(without)


def test_hybrid_fallback_takes_the_evaluators_rounds(tiny, tiny_sets, tiny_drafter):
    spec = DrafterSpec.parse(f"hybrid:conf=0.5:{tiny_drafter}")
    checked = serve_check(
        tiny, spec, [tiny_sets["eval"]], ways=("dflash",), batch_size=4, log=lambda m: None
    )
    assert checked["drafter"].startswith("hybrid:conf=0.5:")
    rounds = _assert_served_exactly(checked)
    rollouts = RolloutSet.open(tiny_sets["eval"])
    # the fallback changed rounds: neither the drafter alone nor lookup alone takes these
    assert rounds != _offline_rounds(tiny, DrafterSpec.parse(str(tiny_drafter)), rollouts)
    assert rounds != _offline_rounds(tiny, DrafterSpec.parse("ngram:k=7"), rollouts)


def test_vllm_without_the_plugin_refuses_a_lookup_export(tiny, lookup_drafter, tmp_path):
    export = export_drafter(lookup_drafter, tmp_path / "export", target=tiny)
    speculative = {"method": "dflash", "model": str(export), "num_speculative_tokens": 7}
    code = (
        "from vllm import LLM\n"
        f"LLM(model={str(model_directory(tiny))!r}, dtype='float32', max_model_len=512,"
        f" enforce_eager=True, speculative_config={json.dumps(speculative)})\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": "none", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "DFlashLookupDraftModel" in done.stderr  # refused for its architecture, loudly


def test_trimmed_drafter_takes_the_evaluators_rounds(tiny, tiny_sets, tiny_drafter):
    """Each step proposes only the slots before the first below `conf`, fewer than K on
    some steps and none on others: vLLM must take the evaluator's rounds of the cut
    blocks, steps that proposed nothing included."""
    spec = DrafterSpec.parse(f"trim:conf=0.5:{tiny_drafter}")
    checked = serve_check(
        tiny, spec, [tiny_sets["eval"]], ways=("dflash",), batch_size=4, log=lambda m: None
    )
    assert checked["drafter"].startswith("trim:conf=0.5:")
    rounds = _assert_served_exactly(checked)
    served = checked["benchmarks"][0]["served"]["dflash"]
    assert served["drafts"] < sum(rounds)  # some steps proposed nothing
    rollouts = RolloutSet.open(tiny_sets["eval"])
    # the cut changed rounds: the whole blocks take others
    assert rounds != _offline_rounds(tiny, DrafterSpec.parse(str(tiny_drafter)), rollouts)
