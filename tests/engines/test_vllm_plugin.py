"""blockdraft's vLLM plugin: the torch `expand` kernel it gives vLLM's CPU build, and
sampled (T = 0.7, top-k 20) DFlash decoding served in vLLM next to the offline evaluator.

`expand_to_tokens` is checked against a loop over requests (it needs no vLLM). The served
check needs vLLM: at T > 0 vLLM samples its own text, so its served tau is compared with
the evaluator's MAL on the sampled rollouts through that MAL's 95% CI.
"""

from __future__ import annotations

import pytest
import torch
from enginekit import needs_vllm

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.engines.vllm_plugin import expand_to_tokens
from blockdraft.sampling import SamplingSettings
from blockdraft.serving.serve_check import serve_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_to_tokens_spreads_each_request_over_its_tokens(dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 5, (6,), generator=gen)
        values = torch.randint(-1, 30, (6,), generator=gen).to(dtype)
        if dtype.is_floating_point:
            values = values / 10
        out = torch.full((int(counts.sum()),), 99, dtype=dtype)
        expand_to_tokens(out, values, torch.cumsum(counts, 0).to(torch.int32), -1, 1)
        want = []
        for value, count in zip(values.tolist(), counts.tolist(), strict=True):
            want += [1 if value == -1 else value] * count
        assert out.tolist() == pytest.approx(want), (values, counts)


@needs_vllm
@pytest.mark.slow
def test_sampled_dflash_served_inside_the_offline_ci(tiny, tiny_drafter, tmp_path):
    settings = SamplingSettings(temperature=0.7, top_k=20, max_new_tokens=48, seed=0)
    prompts = load_prompts("stdlib:eval", limit=16)
    generate_rollouts(
        tiny, prompts, tmp_path / "t07", settings, progress=False, prompt_spec="stdlib:eval"
    )
    checked = serve_check(
        tiny, tiny_drafter, [tmp_path / "t07"], ways=("dflash",), batch_size=4,
        log=lambda m: None,
    )  # fmt: skip
    bench = checked["benchmarks"][0]
    served = bench["served"]["dflash"]
    assert served["outputs_equal_rollouts"] is None  # sampled: vLLM's own text
    assert 0 < served["accepted"] < served["drafts"] * 7
    assert bench["agreement"]["dflash"]["inside_offline_ci95"], bench["agreement"]["dflash"]
