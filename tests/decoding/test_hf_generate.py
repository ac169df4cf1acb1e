"""The HF `generate` baseline the demo and bench/decode.py time against: at T = 0 it
emits exactly what our AR loop emits (so the two are timed on the same work), and the
side-by-side timing reports consistent rates."""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding.hf_generate import ar_vs_hf, has_hf_generate, hf_generate_job
from blockdraft.decoding.loop import ar_generate
from random_targets import make_random_target


def test_greedy_hf_generate_equals_our_ar_loop_and_is_timed_side_by_side() -> None:
    target = make_random_target("qwen3", seed=3)
    assert has_hf_generate(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (7,), generator=g).tolist() for _ in range(3)]
    for prompt in prompts:
        ours = ar_generate(target, prompt, temperature=0.0, max_new_tokens=20)
        assert hf_generate_job(target, prompt, 0.0, 20)() == ours
        looked_up = hf_generate_job(target, prompt, 0.0, 20, lookup=4)()
        assert looked_up == ours  # prompt lookup is lossless at T = 0
    timing = ar_vs_hf(target, prompts, 0.0, 12)
    assert timing["hf_tokens_per_s"] > 0 and timing["ar_tokens_per_s"] > 0
    ratio = timing["ar_tokens_per_s"] / timing["hf_tokens_per_s"]
    assert timing["ar_vs_hf"] == pytest.approx(ratio)


def test_targets_without_hf_generate_are_recognised() -> None:
    class Bare:
        model = object()

    assert not has_hf_generate(Bare())
