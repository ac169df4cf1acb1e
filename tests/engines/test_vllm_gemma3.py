"""vLLM serves a DFlash drafter for a Gemma 3 target through blockdraft's plugin, and
agrees with the offline evaluator round for round.

Gemma 3 is where a served drafter can silently read other inputs than it was trained on:
its embeddings are scaled by sqrt(hidden) (the drafter's `input_embedding_scale`, which
vLLM's plain DFlash class ignores) and the plugin supplies the layer features vLLM's Gemma 3
class does not expose, including the top layer's raw output. Exact rounds on the same text
rule out both kinds of mismatch. The target is a small random Gemma 3 (head size 64, which
vLLM's CPU attention supports).
"""

from __future__ import annotations

import pytest
from enginekit import needs_vllm

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.engines.dflash_support import vllm_dflash_problem
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.checkpoint import read_config, resolve_checkpoint
from blockdraft.serving.serve_check import serve_check
from blockdraft.targets.registry import load_target
from blockdraft.training import config_from_dict, train
from random_targets import make_random_target

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A random Gemma 3 saved as a model folder vLLM loads, its rollouts and a drafter."""
    root = tmp_path_factory.mktemp("gemma3")
    random = make_random_target("gemma3", hidden_size=128, num_heads=2, num_kv_heads=1)
    random.model.save_pretrained(root / "model")
    random.tokenizer.save_pretrained(root / "model")
    target = load_target(str(root / "model"), progress=False)
    settings = SamplingSettings(temperature=0, max_new_tokens=40)
    sets = {}
    for name, spec, n in (("train", "stdlib:train", 32), ("eval", "stdlib:eval", 6)):
        prompts = load_prompts(spec, limit=n)
        generate_rollouts(target, prompts, root / name, settings, progress=False, prompt_spec=spec)
        sets[name] = root / name
    cfg = config_from_dict(
        {
            "run_dir": str(root / "run"),
            "seed": 0,
            "num_anchors": 32,
            # the top layer among the features: its raw output, not the final-normed state
            "target": {"layer_ids": [1, 3, 5]},
            "data": {"train_rollouts": str(sets["train"]), "eval_split": 0.1,
                     "max_seq_len": 256},
            "drafter": {"num_layers": 1, "block_size": 8},
            "objective": {"name": "dpace"},
            "optim": {"lr": 3e-3, "batch_size": 8, "max_steps": 40, "warmup_steps": 4},
            "eval": {"every": 0, "at_start": False},
            "checkpoint": {"save_every": 0},
            "logging": {"every": 20, "progress": False, "tensorboard": False},
        }
    )  # fmt: skip
    drafter = train(cfg, target=target)
    return target, drafter, sets


def test_the_plugin_makes_gemma3_servable(gemma):
    target, drafter, _ = gemma
    assert target.model.config.architectures == ["Gemma3ForCausalLM"]
    assert (
        vllm_dflash_problem(read_config(resolve_checkpoint(drafter)), target.model.config) is None
    )


def test_gemma3_served_lossless_with_the_evaluators_rounds(gemma):
    target, drafter, sets = gemma
    checked = serve_check(
        target, drafter, [sets["eval"]], ways=("dflash",), batch_size=3, log=lambda m: None
    )
    bench = checked["benchmarks"][0]
    served, offline = bench["served"]["dflash"], bench["offline"]["dflash"]
    assert served["outputs_equal_rollouts"] == bench["num_prompts"]
    assert bench["agreement"]["dflash"]["exact"], bench["agreement"]["dflash"]
    assert served["served_tau"] == pytest.approx(offline["mal"], rel=1e-12)
    assert 0 < served["accepted"] < served["drafts"] * 7  # not vacuous
