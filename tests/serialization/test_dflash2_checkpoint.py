"""DFlash2 checkpoints without the reference: round trips, and a z-lab-layout fixture.

`fixtures/zlab-dflash2-tiny/config.json` is written by hand in the key layout of z-lab's
published DFlash2 configs (dflash_config with conv/selector keys, sliding layers,
output multiplier and softcap), sized for the random test target. Its weights are made
here under the names of z-lab's published safetensors header (codebooks without
`.weight`), listed by hand, so a loader that put a tensor in the wrong place fails.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel

from blockdraft.decoding.proposers import draft_block
from blockdraft.drafters.dflash import DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.serialization.checkpoint import (
    config_from_serving,
    load_drafter,
    save_drafter,
)
from blockdraft.serialization.export import ExportError, export_drafter, validate_for_serving
from random_targets import make_random_target

FIXTURE = Path(__file__).parent / "fixtures" / "zlab-dflash2-tiny"


@pytest.fixture(scope="module")
def target():
    t = make_random_target("qwen3", num_layers=6)
    assert t.vocab_size == 375 and t.hidden_size == 64 and t.mask_token_id == 2
    return t


def _zlab_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Names and shapes of z-lab's DFlash2 header, at the fixture's sizes (H 64, I 128,
    4 x 16 q heads, 2 kv heads, 3 target layers, 2 layers, taps 2, groups 64/16 = 4,
    rank 8, vocab 375)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "candidate_selector.hidden_projection.weight": (8, 64),
        "candidate_selector.predecessor_codebook": (375, 8),
        "candidate_selector.successor_codebook": (375, 8),
        "fc.weight": (64, 192),
        "hidden_norm.weight": (64,),
        "norm.weight": (64,),
    }
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_conv.base_kernel": (2, 2, 64),
            p + "attention_conv.kernel_projection.weight": (16, 64),
            p + "mlp_conv.base_kernel": (2, 2, 64),
            p + "mlp_conv.kernel_projection.weight": (16, 64),
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
            p + "mlp.down_proj.weight": (64, 128),
            p + "mlp.gate_proj.weight": (128, 64),
            p + "mlp.up_proj.weight": (128, 64),
            p + "self_attn.k_norm.weight": (16,),
            p + "self_attn.q_norm.weight": (16,),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.o_proj.weight": (64, 64),
        })  # fmt: skip
    return {k: torch.randn(s, generator=g) * 0.3 for k, s in shapes.items()}


def _published_dir(tmp_path: Path, weights: dict[str, torch.Tensor]) -> Path:
    out = tmp_path / "published"
    shutil.copytree(FIXTURE, out)
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_fixture_config_is_read_as_zlab_reads_it(target):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    c = config_from_serving(cfg, target)
    assert c.arch == "dflash2" and c.block_size == 5 and c.num_hidden_layers == 2
    selector = (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k)
    assert selector == (2, 16, 8, 6)
    assert c.layer_types == ["sliding_attention"] * 2 and c.sliding_window == 4
    assert [c.layer_attention(i) for i in range(2)] == [(False, 4)] * 2  # is_causal: false
    assert (c.output_multiplier, c.final_logit_softcapping) == (0.5, 20.0)
    # without is_causal, z-lab's rule makes sliding layers causal
    no_flag = {k: v for k, v in cfg.items() if k != "is_causal"}
    assert config_from_serving(no_flag, target).layer_attention(0) == (True, 4)
    # without use_sliding_window transformers drops the window (the layers stay "sliding")
    unwindowed = config_from_serving({**cfg, "use_sliding_window": False}, target)
    assert unwindowed.layer_attention(1) == (False, None)
    with pytest.raises(ValueError, match="DFlash2 keys"):
        config_from_serving({**cfg, "architectures": ["DFlashDraftModel"]}, target)
    broken = json.loads(json.dumps(cfg))
    del broken["dflash_config"]["selector_rank"]
    with pytest.raises(ValueError, match="selector_rank"):
        config_from_serving(broken, target)


@pytest.mark.parametrize("spelling", ["file", "module"])
def test_published_layout_loads_strictly_by_name(target, tmp_path, spelling):
    weights = _zlab_weights()
    stored = dict(weights)
    if spelling == "module":  # what z-lab's save_pretrained writes (nn.Embedding names)
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            stored[key + ".weight"] = stored.pop(key)
    path = _published_dir(tmp_path, stored)
    if spelling == "file":  # the published spelling is what engines are checked against
        assert validate_for_serving(path) == []
    drafter = load_drafter(path, target)
    assert isinstance(drafter, DFlash2Drafter)
    state = drafter.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    # the logit transform of the config: cap * tanh(0.5 * h W^T / cap)
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    want = 20.0 * torch.tanh(0.5 * (h @ target.lm_head.weight.T) / 20.0)
    torch.testing.assert_close(drafter.compute_logits(h), want)


def test_validator_derives_dflash2_weights_from_the_config(target, tmp_path):
    weights = _zlab_weights()
    weights["layers.1.mlp_conv.kernel_projection.weight"] = torch.zeros(8, 64)
    del weights["candidate_selector.successor_codebook"]
    problems = validate_for_serving(_published_dir(tmp_path, weights))
    assert any("mlp_conv.kernel_projection.weight has shape (8, 64)" in p for p in problems)
    assert any("missing weight candidate_selector.successor_codebook" in p for p in problems)


def _logits(drafter, target):
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    feats = target.forward(ids).features
    anchors = torch.tensor([[0, 4, 7]])
    with torch.no_grad():
        hidden = drafter.forward_blocks(feats, ids, anchors)
        return drafter.compute_logits(hidden, ids[:, 1:5].expand(3, 4)[None])


@pytest.mark.parametrize("layers", [None, ["sliding_attention", "full_attention"]])
def test_round_trip_and_serving_keys_alone(target, tmp_path, layers):
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=5, arch="dflash2",
                                   selector_rank=8, selector_top_k=6)  # fmt: skip
    cfg = DrafterConfig.from_dict({**cfg.to_dict(), "layer_types": layers, "sliding_window": 3,
                                   "output_multiplier": 0.8})  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg).bind_target(target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "hidden_projection" in name:
                p.normal_(std=0.3)
    path = save_drafter(drafter, tmp_path / "c")
    loaded = load_drafter(path, target)
    assert loaded.config == drafter.config
    assert torch.equal(_logits(loaded, target), _logits(drafter, target))
    served = export_drafter(path, tmp_path / "served")
    public = json.loads((served / "config.json").read_text())
    assert public["architectures"] == ["DFlash2DraftModel"]
    public.pop("blockdraft")
    (served / "config.json").write_text(json.dumps(public))
    again = load_drafter(served, target)
    assert again.config == drafter.config
    assert torch.equal(_logits(again, target), _logits(drafter, target))


def _reduced_vocabulary_drafter(target) -> DFlash2Drafter:
    """1 layer, selector rank 8 over the top 6, on a 50-token draft vocabulary (every other id
    from 3), with a non-zero selector modulation."""
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5, arch="dflash2",
                                   selector_rank=8, selector_top_k=6,
                                   draft_vocab_size=50)  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg).bind_target(target).eval()
    drafter.set_draft_vocab(torch.arange(3, 103, 2))
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_(std=0.5)
    return drafter


def test_reduced_vocabulary_round_trips_and_export_refuses_it(target, tmp_path):
    """A DFlash2 drafter on a reduced draft vocabulary saves and loads (codebooks of D and
    D + 1 rows, its `d2t`), and export says in one line why z-lab's format cannot hold it."""
    drafter = _reduced_vocabulary_drafter(target)
    path = save_drafter(drafter, tmp_path / "c")
    loaded = load_drafter(path, target)
    assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    assert torch.equal(_logits(loaded, target), _logits(drafter, target))
    with pytest.raises(ExportError, match="draft_vocab_size 50: z-lab's DFlash2 format"):
        export_drafter(path, tmp_path / "served", target=target)
    assert not (tmp_path / "served").exists()


def test_expand_vocab_writes_the_full_vocabulary_layout(target, tmp_path):
    """`expand_vocab`: a reduced-vocabulary DFlash2 export in z-lab's layout (no d2t, codebooks
    over the target's vocabulary) that scores every candidate set inside D after any
    predecessor exactly as the trained drafter, and a token outside D by its unary logit
    alone; unary logits on D unchanged."""
    drafter = _reduced_vocabulary_drafter(target)
    path = save_drafter(drafter, tmp_path / "c")
    out = export_drafter(path, tmp_path / "served", target=target, expand_vocab=True)
    assert validate_for_serving(out) == []
    cfg_json = json.loads((out / "config.json").read_text())
    assert "draft_vocab_size" not in cfg_json
    full = load_drafter(out, target).eval()
    assert full.config.draft_vocab_size is None and full.draft_ids is None
    ids, vocab = drafter.draft_ids, target.vocab_size
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(8, drafter.config.hidden_size, generator=g)
    top = torch.randn(8, 6, generator=g)
    columns = torch.randint(0, 50, (8, 6), generator=g)
    outside = torch.tensor([t for t in range(vocab) if t not in set(ids.tolist())])
    # predecessors inside and outside D (the anchor can be any token)
    prev = torch.cat([ids[:4], outside[:4]])
    with torch.no_grad():
        want = drafter.candidate_selector.score(
            hidden, columns, top, drafter.predecessor_rows(prev)
        )
        got = full.candidate_selector.score(hidden, ids[columns], top, full.predecessor_rows(prev))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        alone = full.candidate_selector.score(hidden, outside[:6].expand(8, -1), top, prev)
        assert torch.equal(alone, top)
        torch.testing.assert_close(
            full.unary_logits(hidden)[:, ids], drafter.unary_logits(hidden), rtol=0, atol=1e-6
        )


def test_automodel_builds_the_dflash2_export(target, tmp_path):
    """`modeling_dflash.py` (self-contained) computes our drafter: hidden states of a block
    and its greedy proposals, sliding + causal layers, multiplier and softcap included."""
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=5, arch="dflash2",
                                   selector_rank=8, selector_top_k=6)  # fmt: skip
    cfg = DrafterConfig.from_dict({**cfg.to_dict(), "sliding_window": 3, "output_multiplier": 0.6,
                                   "layer_types": ["sliding_attention", "full_attention"],
                                   "final_logit_softcapping": 4.0})  # fmt: skip
    torch.manual_seed(2)
    drafter = DFlash2Drafter(cfg).bind_target(target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "hidden_projection" in name:
                p.normal_(std=0.4)
    served = export_drafter(save_drafter(drafter, tmp_path / "c"), tmp_path / "served")
    config = json.loads((served / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    model = AutoModel.from_pretrained(str(served), trust_remote_code=True).eval()
    assert type(model).__name__ == "DFlash2DraftModel"
    ids = torch.randint(3, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    a, kb = 8, cfg.block_size
    with torch.no_grad():
        feats = target.forward(ids).features
        state = drafter.new_state()
        drafter.extend_context(state, feats[:, :a], 0)
        ours = drafter.draft_hidden(state, int(ids[0, a]), a)
        block = torch.full((1, kb), cfg.mask_token_id)
        block[0, 0] = ids[0, a]
        hidden = model(noise_embedding=drafter.embed(block), target_hidden=feats[:, :a],
                       position_ids=torch.arange(a + kb)[None])  # fmt: skip
        torch.testing.assert_close(hidden[0, 1:], ours, rtol=1e-5, atol=1e-5)
        tokens = model.propose(hidden[:, 1:], ids[:, a], target.lm_head.weight)
        mine, _ = draft_block(drafter, state, int(ids[0, a]), a, 0.0, 1.0, 0, None)
    assert torch.equal(tokens[0], mine)
    assert torch.equal(model.candidate_selector.successor_codebook,
                       drafter.candidate_selector.successor_codebook)  # fmt: skip
