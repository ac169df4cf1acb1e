"""The block drafter: training forward == per-block inference, masks, cache, geometry."""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters.config import _rope_from_hf
from blockdraft.drafters.dflash import (
    BlockDrafter,
    DrafterConfig,
    block_attention_mask,
    sample_from_logits,
)
from blockdraft.drafters.semi_ar import SemiARDrafter
from random_targets import make_random_target

ARCHS = ["qwen3", "llama", "gemma3"]
BLOCK = 4  # K = 3 proposals


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return make_random_target(request.param, num_layers=6)


def _drafter(target, kind: str = "dflash", layers: int = 2) -> BlockDrafter:
    cfg = DrafterConfig.for_target(
        target, num_layers=layers, block_size=BLOCK, arch=kind, markov_rank=8
    )
    model = (SemiARDrafter if kind == "semi_ar" else BlockDrafter)(cfg).bind_target(target)
    if kind == "semi_ar":  # make the Markov head non-trivial so it is actually tested
        torch.nn.init.normal_(model.markov_head.w2, std=0.5)
    return model.eval()


def _batch(target, B: int = 2, T: int = 14):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g)
    return ids, target.forward(ids).features


def _prev_tokens(ids: torch.Tensor, anchors: torch.Tensor, K: int) -> torch.Tensor:
    """Teacher-forced previous tokens [B, A, K]: anchor, then labels x_{a+1}..x_{a+K-1}."""
    T = ids.shape[1]
    idx = (anchors.clamp(min=0)[..., None] + torch.arange(K)).clamp(max=T - 1)
    return torch.stack([ids[b][idx[b]] for b in range(ids.shape[0])])


def _one_block(drafter, features, ids, b, a, prev=None):
    state = drafter.new_state()
    drafter.extend_context(state, features[b : b + 1, :a], 0)
    if prev is None:
        return drafter.draft_logits(state, int(ids[b, a]), a)
    return drafter.compute_logits(drafter.draft_hidden(state, int(ids[b, a]), a), prev)


@pytest.mark.parametrize("kind", ["dflash", "semi_ar"])
def test_training_forward_equals_per_block_inference(target, kind):
    drafter = _drafter(target, kind)
    ids, feats = _batch(target)
    anchors = torch.tensor([[0, 5, 9, 2, -1], [13, 1, 7, 7, 4]])  # repeats and padding
    prev = _prev_tokens(ids, anchors, BLOCK - 1)
    with torch.no_grad():
        logits = drafter.compute_logits(drafter.forward_blocks(feats, ids, anchors), prev)
    assert logits.shape == (2, 5, BLOCK - 1, target.vocab_size)
    assert torch.isfinite(logits[0, 4]).all()  # padding block stays finite
    for b in range(2):
        for j in range(5):
            a = int(anchors[b, j])
            if a < 0:
                continue
            ref = _one_block(drafter, feats, ids, b, a, prev[b, j] if kind == "semi_ar" else None)
            torch.testing.assert_close(logits[b, j], ref, rtol=1e-5, atol=2e-5)


def test_mask_is_what_the_contract_says():
    anchors = torch.tensor([[2, 0, -1]])
    mask = block_attention_mask(anchors, seq_len=4, block_size=2)[0, 0]
    expected_ctx = torch.tensor([[1, 1, 0, 0]] * 2 + [[0, 0, 0, 0]] * 4, dtype=torch.bool)
    assert torch.equal(mask[:, :4], expected_ctx)
    own = torch.block_diag(*[torch.ones(2, 2)] * 3).bool()
    assert torch.equal(mask[:, 4:], own)


def test_forbidden_inputs_do_not_matter_allowed_ones_do(target):
    drafter = _drafter(target)
    ids, feats = _batch(target, B=1, T=12)
    anchors = torch.tensor([[6, 3]])
    with torch.no_grad():
        base = drafter.forward_blocks(feats, ids, anchors)
        # features at indices >= 6 are invisible to block 0; >= 3 to block 1
        f2 = feats.clone()
        f2[:, 6:] += torch.randn_like(f2[:, 6:])
        out = drafter.forward_blocks(f2, ids, anchors)
        torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=0)
        assert (out[:, 1] - base[:, 1]).abs().max() == 0  # block 1 sees only < 3
        f3 = feats.clone()
        f3[:, 4] += 1.0  # visible to block 0 (4 < 6), not to block 1 (4 >= 3)
        out = drafter.forward_blocks(f3, ids, anchors)
        assert (out[:, 0] - base[:, 0]).abs().max() > 1e-4
        assert torch.equal(out[:, 1], base[:, 1])
        # another block's anchor token never leaks: change block 1's anchor token (index 3)
        # - block 0 sees index 3 only through its context *features*, which we keep fixed.
        i2 = ids.clone()
        i2[0, 3] = (i2[0, 3] + 1) % target.vocab_size
        out = drafter.forward_blocks(feats, i2, anchors)
        assert torch.equal(out[:, 0], base[:, 0])
        assert (out[:, 1] - base[:, 1]).abs().max() > 1e-4
        # a block's own anchor token matters
        i3 = ids.clone()
        i3[0, 6] = (i3[0, 6] + 1) % target.vocab_size
        out = drafter.forward_blocks(feats, i3, anchors)
        assert (out[:, 0] - base[:, 0]).abs().max() > 1e-4


def test_cache_with_crops_equals_recomputation(target):
    drafter = _drafter(target)
    ids, feats = _batch(target, B=1, T=12)
    _, other = _batch(target, B=1, T=12)
    other = other + 0.5
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :3], 0)
    drafter.extend_context(state, feats[:, 3:8], 3)
    state.crop(5)  # rejected suffix: positions 5..7 go away
    drafter.extend_context(state, other[:, 5:9], 5)  # different features this time
    assert state.length == 9
    got = drafter.draft_logits(state, int(ids[0, 9]), 9)
    mixed = torch.cat([feats[:, :5], other[:, 5:9]], dim=1)
    fresh = drafter.new_state()
    drafter.extend_context(fresh, mixed, 0)
    torch.testing.assert_close(
        got, drafter.draft_logits(fresh, int(ids[0, 9]), 9), rtol=1e-5, atol=1e-5
    )
    # the training path on the same features agrees too
    full_feats = torch.cat([mixed, feats[:, 9:]], dim=1)
    hidden = drafter.forward_blocks(full_feats, ids, torch.tensor([[9]]))
    torch.testing.assert_close(drafter.compute_logits(hidden)[0, 0], got, rtol=1e-5, atol=2e-5)
    # extra cached positions beyond the anchor are ignored
    drafter.extend_context(state, other[:, 9:11], 9)
    torch.testing.assert_close(drafter.draft_logits(state, int(ids[0, 9]), 9), got, rtol=0, atol=0)


def test_state_errors(random_target):
    drafter = _drafter(random_target)
    _, feats = _batch(random_target, B=1, T=6)
    state = drafter.new_state()
    with pytest.raises(ValueError, match="contiguously"):
        drafter.extend_context(state, feats[:, :2], 1)
    drafter.extend_context(state, feats[:, :2], 0)
    with pytest.raises(ValueError, match="needs 4"):
        drafter.draft_logits(state, 1, 4)
    with pytest.raises(ValueError, match="cannot crop"):
        state.crop(3)
    with pytest.raises(ValueError, match="expects"):
        drafter.extend_context(state, feats[:, 2:3, :-1], 2)


def test_shared_modules_are_not_parameters(random_target):
    drafter = _drafter(random_target)
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    n_params = sum(p.numel() for p in drafter.parameters())
    assert n_params < sum(p.numel() for p in random_target.model.parameters())
    assert drafter.head_weight.data_ptr() == random_target.lm_head.weight.data_ptr()
    with pytest.raises(RuntimeError, match="bind_target"):
        BlockDrafter(drafter.config).forward_blocks(
            torch.zeros(1, 2, drafter.config.feature_size),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
        )


def test_for_target_copies_geometry(target):
    cfg = DrafterConfig.for_target(target, num_layers=3, block_size=8)
    c = target.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    assert cfg.intermediate_size == c.intermediate_size and cfg.rms_norm_eps == c.rms_norm_eps
    assert cfg.target_layer_ids == target.layer_ids and cfg.num_target_layers == target.num_layers
    assert cfg.mask_token_id == target.mask_token_id and cfg.vocab_size == target.vocab_size
    assert cfg.num_proposals == 7 and cfg.feature_size == target.feature_size
    assert cfg.qk_norm  # serving engines always apply q/k norm
    expected_theta = 1_000_000.0 if target.name.endswith("gemma3") else 10000.0
    assert cfg.rope_theta == expected_theta and cfg.rope_scaling is None


def test_rope_matches_transformers(target):
    """Drafter RoPE cos/sin equal the target family's own rotary embedding (independent code)."""
    drafter = _drafter(target)
    pos = torch.arange(0, 40)[None]
    cos, sin = drafter._rope(pos)
    rotary = target.model.model.rotary_emb
    x = torch.zeros(1, 40, drafter.config.head_dim)
    kwargs = {"layer_type": "full_attention"} if target.name.endswith("gemma3") else {}
    ref_cos, ref_sin = rotary(x, pos, **kwargs)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_is_carried():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    theta, got_scaling = _rope_from_hf(hf)
    assert theta == 500000.0 and got_scaling["rope_type"] == "llama3"
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        mask_token_id=1,
        target_layer_ids=[1],
        num_target_layers=4,
        target_hidden_size=64,
        rope_theta=theta,
        rope_scaling=got_scaling,
    )
    ref = LlamaRotaryEmbedding(hf).inv_freq
    torch.testing.assert_close(BlockDrafter(cfg).inv_freq, ref)
    assert not torch.allclose(
        ref, 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16)
    )  # scaling did something


def test_config_validation(random_target):
    with pytest.raises(ValueError, match="num_hidden_layers"):
        DrafterConfig.for_target(random_target, num_layers=9)
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig.for_target(random_target, block_size=1)
    with pytest.raises(ValueError, match="unknown drafter arch"):
        DrafterConfig.for_target(random_target, arch="eagle")
    with pytest.raises(ValueError, match="unknown drafter config key"):
        DrafterConfig.from_dict({**DrafterConfig.for_target(random_target).to_dict(), "bogus": 1})
    cfg = DrafterConfig.for_target(random_target)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_forward_blocks_input_errors(random_target):
    drafter = _drafter(random_target)
    ids, feats = _batch(random_target, B=1, T=6)
    with pytest.raises(ValueError, match="anchors must be in"):
        drafter.forward_blocks(feats, ids, torch.tensor([[6]]))
    with pytest.raises(ValueError, match="shape mismatch"):
        drafter.forward_blocks(feats[:, :5], ids, torch.tensor([[1]]))


def test_sampling_contract(random_target):
    drafter = _drafter(random_target)
    _, feats = _batch(random_target, B=1, T=6)
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :5], 0)
    logits = drafter.draft_logits(state, 3, 5)
    tokens, q = drafter.sample_block(state, 3, 5, temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, logits.shape[-1]).float())
    g = torch.Generator().manual_seed(0)
    tokens, q = drafter.sample_block(state, 3, 5, temperature=0.7, generator=g)
    torch.testing.assert_close(q, torch.softmax(logits / 0.7, -1))
    # tokens really are drawn from q: empirical frequencies over many draws
    big = logits[:1].expand(20000, -1) * 0.05
    toks, qq = sample_from_logits(big, 1.0, torch.Generator().manual_seed(1))
    freq = torch.bincount(toks, minlength=big.shape[-1]).float() / toks.numel()
    assert (freq - qq[0]).abs().max() < 0.01
