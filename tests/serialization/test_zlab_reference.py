"""Against z-lab's own classes (tests/zlab_reference.py: z-lab's `dflash` package, or a
checkout named by `BLOCKDRAFT_ZLAB_DFLASH`; skipped without either): their random-weight
checkpoints load here and compute the same thing, our DFlash2 exports load strictly into
theirs, and their decoding loop drafts with our export what ours drafts.
tests/serialization/test_dflash2_checkpoint.py covers the format without the reference.
"""

from __future__ import annotations

import time

import pytest
import torch

import blockdraft.decoding.loop as decoding_loop
from blockdraft.decoding.loop import ar_generate, speculative_generate
from blockdraft.decoding.proposers import proposer_for
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.serialization.checkpoint import load_drafter, save_drafter
from blockdraft.serialization.export import export_drafter, validate_for_serving
from dflash2_fit import fit_dflash2
from random_targets import make_random_target
from zlab_reference import assert_same_as_reference, reference_checkpoint, zlab_model

BLOCK = 5


@pytest.fixture(scope="module")
def zlab():
    return zlab_model()


@pytest.fixture(scope="module")
def target():
    return make_random_target("qwen3", num_layers=6)


VARIANTS = {
    "dflash-full": dict(arch="dflash"),
    "dflash-sliding": dict(
        arch="dflash", layer_types=["sliding_attention", "full_attention"], sliding_window=4
    ),  # fmt: skip
    "dflash2-sliding": dict(
        arch="dflash2",
        layer_types=["sliding_attention"] * 2,
        sliding_window=4,
        is_causal=False,
        output_multiplier=0.7,
        final_logit_softcapping=5.0,
    ),  # fmt: skip
    "dflash2-full": dict(arch="dflash2"),
    "dflash2-causal": dict(
        arch="dflash2", layer_types=["sliding_attention"] * 2, sliding_window=3
    ),  # fmt: skip
}


def _config(target, variant) -> DrafterConfig:
    opts = dict(VARIANTS[variant])
    arch = opts.pop("arch")
    cfg = DrafterConfig.for_target(
        target, num_layers=2, block_size=BLOCK, arch=arch, selector_rank=8, selector_top_k=6
    )
    return DrafterConfig.from_dict({**cfg.to_dict(), **opts})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_checkpoints_load_and_agree(zlab, target, tmp_path, variant):
    config = _config(target, variant)
    ref, path = reference_checkpoint(zlab, config, tmp_path / "c")
    ours = load_drafter(path, target).eval()
    assert type(ours) is (DFlash2Drafter if config.arch == "dflash2" else BlockDrafter)
    for key in ("layer_types", "sliding_window", "output_multiplier", "selector_top_k",
                "conv_kernel_size", "final_logit_softcapping"):  # fmt: skip
        assert getattr(ours.config, key) == getattr(config, key), key
    assert_same_as_reference(ref, ours, target)


@pytest.mark.parametrize("variant", ["dflash2-sliding", "dflash2-full"])
def test_our_dflash2_export_loads_strictly_into_the_reference(zlab, target, tmp_path, variant):
    config = _config(target, variant)
    torch.manual_seed(3)
    ours = DFlash2Drafter(config).bind_target(target).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "conv" in name or "hidden_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    out = export_drafter(save_drafter(ours, tmp_path / "c"), tmp_path / "served")
    assert validate_for_serving(out) == []
    ref, info = zlab.DFlash2DraftModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_as_reference(ref.float().eval(), ours, target)


@pytest.mark.parametrize("variant", ["dflash2-sliding", "dflash2-full"])
def test_zlab_decoding_loop_drafts_our_export_round_for_round(zlab, tmp_path, monkeypatch, variant):
    """z-lab's own greedy loop (`dflash_generate`) running our exported drafter drafts the
    same tokens as our loop in every round, so it accepts the same runs and emits the
    same text: context features, positions, the drafter's cache across rounds and the
    selector's chain all agree, not just one block. The drafter is fitted to the target's
    greedy text first (tests/dflash2_fit.py) briefly, so rounds accept 0 to K tokens (a
    Llama target: an untied head writes cycles, where a tied one repeats one token)."""
    target = make_random_target("llama", seed=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, target.vocab_size, (5,), generator=g).tolist() for _ in range(8)]
    seqs = [torch.tensor(p + ar_generate(target, p, max_new_tokens=24)) for p in prompts]
    config = _config(target, variant)
    torch.manual_seed(0)
    ours = fit_dflash2(DFlash2Drafter(config).bind_target(target), target, seqs, steps=20)
    out = export_drafter(save_drafter(ours, tmp_path / "c"), tmp_path / "served")
    ref = zlab.DFlash2DraftModel.from_pretrained(out).float().eval()

    theirs: list[list[int]] = []
    propose = ref.propose

    def recorded_propose(*args, **kwargs):
        tokens, *rest = propose(*args, **kwargs)
        theirs.append(tokens[0].tolist())
        return (tokens, *rest)

    monkeypatch.setattr(ref, "propose", recorded_propose)
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats clock is CUDA's
    mine: list[list[int]] = []

    def recording_proposer(drafter, sampling):
        proposer = proposer_for(drafter, sampling)
        inner = proposer.propose

        def propose_and_record(*args):
            proposal = inner(*args)
            mine.append(proposal.tokens.tolist())
            return proposal

        proposer.propose = propose_and_record
        return proposer

    monkeypatch.setattr(decoding_loop, "proposer_for", recording_proposer)
    new, lengths = 20, set()
    stops = sorted(target.stop_token_ids)
    for prompt in prompts[:4]:
        theirs.clear()
        mine.clear()
        trace = speculative_generate(target, ours, prompt, 0.0, max_new_tokens=new)
        # BLOCK more tokens for theirs, so its blocks are whole wherever ours drafted
        ids = torch.tensor([prompt])
        res = zlab.dflash_generate(ref, target.model, ids, new + BLOCK, stops, return_stats=True)
        assert res.output_ids[0, len(prompt) :].tolist()[: len(trace.tokens)] == trace.tokens
        assert theirs[: len(mine)] == mine
        assert res.acceptance_lengths[: len(mine) - 1] == trace.emitted[:-1]
        lengths.update(trace.accepted)
    assert {0, BLOCK - 1} < lengths  # rejections, whole blocks and partial runs


def test_expanded_reduced_vocabulary_export_loads_strictly_into_the_reference(
    zlab, target, tmp_path
):
    """A DFlash2 drafter trained on a reduced draft vocabulary, exported with
    `expand_vocab`: z-lab's class loads it strictly and computes what ours computes."""
    config = _config(target, "dflash2-sliding")
    config = DrafterConfig.from_dict({**config.to_dict(), "draft_vocab_size": 60})
    torch.manual_seed(3)
    ours = DFlash2Drafter(config).bind_target(target).eval()
    ours.set_draft_vocab(torch.arange(2, 122, 2))
    with torch.no_grad():
        ours.candidate_selector.hidden_projection.weight.normal_(std=0.4)
    out = export_drafter(
        save_drafter(ours, tmp_path / "c"), tmp_path / "served", target=target, expand_vocab=True
    )
    ref, info = zlab.DFlash2DraftModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_as_reference(ref.float().eval(), load_drafter(out, target).eval(), target)
