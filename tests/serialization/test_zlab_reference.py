"""Against z-lab's own classes: their random-weight checkpoints load here and compute the
same thing, and our DFlash2 exports load strictly into theirs.

The reference is z-lab's `dflash` package from PyPI (0.1.0 holds `DFlash2DraftModel`;
`make install` puts it in the venv without its pinned dependencies, since `dflash.model`
needs only torch and transformers), or a checkout of github.com/z-lab/dflash named by
`BLOCKDRAFT_ZLAB_DFLASH` (the directory holding `dflash/model.py`), which wins when set.
Without either every test here is skipped; tests/serialization/test_dflash2_checkpoint.py
covers the format without the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

import blockdraft.decoding.loop as decoding_loop
from blockdraft.decoding.loop import ar_generate, speculative_generate
from blockdraft.decoding.proposers import draft_block, proposer_for
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.serialization.checkpoint import load_drafter, save_drafter, serving_config
from blockdraft.serialization.export import export_drafter, validate_for_serving
from blockdraft.targets.testing import make_random_target
from dflash2_fit import fit_dflash2

BLOCK = 5
ANCHOR = 9


@pytest.fixture(scope="module")
def zlab():
    root = os.environ.get("BLOCKDRAFT_ZLAB_DFLASH")
    if root:
        if not (Path(root) / "dflash" / "model.py").is_file():
            pytest.fail(f"BLOCKDRAFT_ZLAB_DFLASH={root}: no dflash/model.py there")
        sys.path.insert(0, root)
        try:
            model = importlib.import_module("dflash.model")
        finally:
            sys.path.remove(root)
        where = f"{root}/dflash/model.py"
    else:
        if importlib.util.find_spec("dflash") is None:
            pytest.skip("z-lab's reference not installed: pip install --no-deps dflash==0.1.0")
        model = importlib.import_module("dflash.model")
        where = model.__file__
    if not hasattr(model, "DFlash2DraftModel"):
        pytest.fail(f"{where} predates DFlash2 (no DFlash2DraftModel)")
    return model


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


def _reference_checkpoint(zlab, config: DrafterConfig, path: Path):
    """A checkpoint written by z-lab's class with random weights (ours only for its config)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(serving_config(config)))
    hf = Qwen3Config.from_pretrained(path)
    cls = zlab.DFlash2DraftModel if config.arch == "dflash2" else zlab.DFlashDraftModel
    torch.manual_seed(7)
    ref = cls(hf)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = 0.5 if "conv" in name or "norm" in name else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0))
    ref.save_pretrained(path / "ref")
    return ref.eval(), path / "ref"


def _reference_block(zlab, ref, target, feats, anchor_id):
    ids = torch.full((1, BLOCK), ref.mask_token_id, dtype=torch.long)
    ids[0, 0] = anchor_id
    with torch.no_grad():
        noise = target.embed_tokens(ids)
        hidden = ref(
            position_ids=torch.arange(ANCHOR + BLOCK)[None],
            noise_embedding=noise,
            target_hidden=feats[:, :ANCHOR],
        )
    return hidden[:, 1:]


def _ours_block(drafter, feats, anchor_id):
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :ANCHOR], 0)
    return state, drafter.draft_hidden(state, anchor_id, ANCHOR)


def _compare(zlab, ref, ours, target):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (1, 14), generator=g)
    feats = target.forward(ids).features
    anchor = int(ids[0, ANCHOR])
    want = _reference_block(zlab, ref, target, feats, anchor)[0]
    state, got = _ours_block(ours, feats, anchor)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the training forward too, at this anchor among others
    with torch.no_grad():
        many = ours.forward_blocks(feats, ids, torch.tensor([[3, ANCHOR, 12]]))
    torch.testing.assert_close(many[0, 1], want, rtol=1e-4, atol=1e-4)
    head = target.lm_head
    with torch.no_grad():
        if isinstance(ours, DFlash2Drafter):
            tokens, _, _ = ref.propose(want[None], torch.tensor([anchor]), head, 0.0)
            mine, _ = draft_block(ours, state, anchor, ANCHOR, 0.0, 1.0, 0, None)
            assert torch.equal(mine, tokens[0])
            # T > 0: the reference's sampled path and its q over the candidates equal
            # our teacher-forced selector distribution along that path
            torch.manual_seed(5)
            path, cand, q = ref.propose(want[None], torch.tensor([anchor]), head, 0.9)
            prev = torch.cat([torch.tensor([anchor]), path[0, :-1]])
            ours_q = torch.softmax(ours.compute_logits(got, prev).float() / 0.9, -1)
            ref_q = torch.zeros_like(ours_q).scatter(-1, cand[0], q[0])
            torch.testing.assert_close(ours_q, ref_q, rtol=1e-4, atol=1e-5)
        else:
            logits = ref.compute_logits(want, head)
            torch.testing.assert_close(ours.compute_logits(got), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_checkpoints_load_and_agree(zlab, target, tmp_path, variant):
    config = _config(target, variant)
    ref, path = _reference_checkpoint(zlab, config, tmp_path / "c")
    ours = load_drafter(path, target).eval()
    assert type(ours) is (DFlash2Drafter if config.arch == "dflash2" else BlockDrafter)
    for key in ("layer_types", "sliding_window", "output_multiplier", "selector_top_k",
                "conv_kernel_size", "final_logit_softcapping"):  # fmt: skip
        assert getattr(ours.config, key) == getattr(config, key), key
    _compare(zlab, ref, ours, target)


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
    _compare(zlab, ref.float().eval(), ours, target)


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
