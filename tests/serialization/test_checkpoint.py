"""Checkpoints: exact round trip, nothing of the target saved, wrong target refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.serialization.checkpoint import load_drafter, save_drafter
from random_targets import make_random_target


def _logits(drafter, target):
    ids = torch.randint(0, target.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    feats = target.forward(ids).features
    anchors = torch.tensor([[0, 4, 8]])
    with torch.no_grad():
        hidden = drafter.forward_blocks(feats, ids, anchors)
        return drafter.compute_logits(hidden, ids[:, :3].expand(3, 3)[None])


@pytest.mark.parametrize("arch", ["dflash", "semi_ar"])
def test_round_trip_is_exact(random_target, tmp_path, arch):
    cfg = DrafterConfig.for_target(
        random_target, num_layers=2, block_size=4, arch=arch, markov_rank=4
    )
    drafter = (SemiARDrafter if arch == "semi_ar" else BlockDrafter)(cfg).bind_target(random_target)
    if arch == "semi_ar":
        torch.nn.init.normal_(drafter.markov_head.w2)
    path = save_drafter(drafter, tmp_path / "ckpt", extra={"objective": "dpace", "step": 7})
    loaded = load_drafter(path, random_target)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    assert torch.equal(_logits(loaded, random_target), _logits(drafter, random_target))
    cfg_json = json.loads((path / "config.json").read_text())
    assert cfg_json["blockdraft"]["extra"] == {"objective": "dpace", "step": 7}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    n_saved = sum(v.numel() for v in drafter.state_dict().values())
    assert n_saved == sum(p.numel() for p in drafter.parameters())


def test_reduced_vocab_round_trip(random_target, tmp_path):
    cfg = DrafterConfig.for_target(random_target, block_size=4, draft_vocab_size=20)
    drafter = BlockDrafter(cfg).bind_target(random_target)
    drafter.set_draft_vocab(torch.arange(0, 100, 5))
    loaded = load_drafter(save_drafter(drafter, tmp_path / "c"), random_target)
    assert torch.equal(loaded.draft_ids, torch.arange(0, 100, 5))
    assert torch.equal(_logits(loaded, random_target), _logits(drafter, random_target))


def test_bfloat16_round_trip_keeps_dtype(random_target, tmp_path):
    drafter = BlockDrafter(DrafterConfig.for_target(random_target, block_size=4)).bind_target(
        random_target
    )
    drafter.to(torch.bfloat16)
    loaded = load_drafter(save_drafter(drafter, tmp_path / "c"), random_target)
    assert loaded.dtype == torch.bfloat16
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1}, "target_hidden_size"),
        ({"vocab_size": 320}, "vocab_size"),
        ({"num_layers": 8}, "target_layer_ids"),
    ],
)
def test_loading_for_another_target_fails_clearly(random_target, tmp_path, kwargs, key):
    drafter = BlockDrafter(DrafterConfig.for_target(random_target, block_size=4)).bind_target(
        random_target
    )
    path = save_drafter(drafter, tmp_path / "c")
    other = make_random_target("qwen3", **kwargs)
    with pytest.raises(ValueError, match=f"{key} is .* in the drafter but .* in target") as info:
        load_drafter(path, other)
    assert "\n" not in str(info.value)


def test_num_target_layers_and_mask_are_checked(random_target, tmp_path):
    drafter = BlockDrafter(DrafterConfig.for_target(random_target, block_size=4)).bind_target(
        random_target
    )
    path = save_drafter(drafter, tmp_path / "c")
    other = make_random_target("qwen3", num_layers=7)
    # force equal layer ids so the layer-count check itself is what fires
    other.layer_ids = list(random_target.layer_ids)
    with pytest.raises(ValueError, match="num_target_layers is 6 in the drafter but 7"):
        load_drafter(path, other)


def test_save_is_atomic_and_loader_errors(random_target, tmp_path):
    drafter = BlockDrafter(DrafterConfig.for_target(random_target, block_size=4)).bind_target(
        random_target
    )
    path = save_drafter(drafter, tmp_path / "c", extra={"step": 1})
    before = (path / "config.json").read_text()
    with pytest.raises(TypeError):
        save_drafter(drafter, path, extra={"bad": object()})
    assert (path / "config.json").read_text() == before  # old checkpoint intact
    save_drafter(drafter, path, extra={"step": 2})  # overwrite works, no leftovers
    assert json.loads((path / "config.json").read_text())["blockdraft"]["extra"]["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(tmp_path / "missing", random_target)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_drafter(path, random_target)


@pytest.mark.parametrize("reduced", [False, True])
def test_serving_keys_alone_reproduce_the_drafter(random_target, tmp_path, reduced):
    """A public-style directory (no 'blockdraft' key, exported) loads as the same model."""
    from blockdraft.serialization.export import export_drafter

    cfg = DrafterConfig.for_target(
        random_target, num_layers=2, block_size=4, draft_vocab_size=24 if reduced else None
    )
    drafter = BlockDrafter(cfg).bind_target(random_target)
    if reduced:
        drafter.set_draft_vocab(torch.arange(1, 73, 3))
    out = export_drafter(
        save_drafter(drafter, tmp_path / "c"), tmp_path / "served", target=random_target
    )
    public = json.loads((out / "config.json").read_text())
    public.pop("blockdraft")
    (out / "config.json").write_text(json.dumps(public))
    loaded = load_drafter(out, random_target)
    assert loaded.config == drafter.config
    assert torch.equal(_logits(loaded, random_target), _logits(drafter, random_target))


def test_unsupported_public_variants_are_refused(random_target, tmp_path):
    drafter = BlockDrafter(DrafterConfig.for_target(random_target, block_size=4))
    path = save_drafter(drafter.bind_target(random_target), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("blockdraft")
    cfg["dflash_config"]["conv_kernel_size"] = 2  # DFlash2 keys under the DFlash name
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="DFlash2 keys"):
        load_drafter(path, random_target)
    del cfg["dflash_config"]["conv_kernel_size"]
    cfg["dflash_config"]["attention_sink_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="attention_sink_bias=True is not supported"):
        load_drafter(path, random_target)
