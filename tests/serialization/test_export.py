"""Serving export: our checkpoints pass the DFlash-loader checks; broken ones are caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.serialization.checkpoint import load_drafter, save_drafter
from blockdraft.serialization.export import (
    expected_weight_shapes,
    export_drafter,
    validate_for_serving,
)
from random_targets import make_random_target


@pytest.fixture(scope="module")
def llama():
    return make_random_target("llama")


def _ckpt(target, path, **kw):
    drafter = BlockDrafter(
        DrafterConfig.for_target(target, num_layers=2, block_size=8, **kw)
    ).bind_target(target)
    return save_drafter(drafter, path), drafter


@pytest.mark.parametrize("which", ["qwen3", "llama"])
def test_our_checkpoints_are_servable(random_target, llama, tmp_path, which):
    target = random_target if which == "qwen3" else llama
    path, drafter = _ckpt(target, tmp_path / "c")
    assert validate_for_serving(path) == []
    cfg = json.loads((path / "config.json").read_text())
    # the independent spec derived from the serving config matches our state_dict exactly
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes == expected_weight_shapes(cfg)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {
        "block_size": 8,
        "mask_token_id": target.mask_token_id,
        "target_layer_ids": target.layer_ids,
    }
    assert cfg["num_target_layers"] == target.num_layers and cfg["block_size"] == 8


def test_serving_config_loads_as_qwen3_config(random_target, tmp_path):
    from transformers import AutoConfig

    path, drafter = _ckpt(random_target, tmp_path / "c")
    hf = AutoConfig.from_pretrained(path)
    c = drafter.config
    assert type(hf).__name__ == "Qwen3Config"
    assert (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
        hf.intermediate_size,
    ) == (
        c.hidden_size,
        2,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
    )
    assert hf.rope_parameters["rope_theta"] == c.rope_theta and hf.is_causal is False
    assert hf.dflash_config["target_layer_ids"] == c.target_layer_ids


def _break(path, drop=None, rename=None, reshape=None, add=None):
    tensors = load_file(str(path / "model.safetensors"))
    if drop:
        tensors.pop(drop)
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    if add:
        tensors.update(add)
    save_file(tensors, str(path / "model.safetensors"))
    # a consistently re-made (not corrupted) file: record its new size and sha256
    from blockdraft.serialization.checkpoint import file_digest

    cfg = json.loads((path / "config.json").read_text())
    cfg["blockdraft"]["weights"] = file_digest(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("mutation", "needle"),
    [
        (
            {"drop": "layers.1.self_attn.k_norm.weight"},
            "missing weight layers.1.self_attn.k_norm.weight",
        ),
        ({"rename": ("fc.weight", "model.fc.weight")}, "unexpected weight model.fc.weight"),
        ({"reshape": "layers.0.mlp.up_proj.weight"}, "layers.0.mlp.up_proj.weight has shape"),
        ({"add": {"embed_tokens.weight": torch.zeros(3, 3)}}, "must not be shipped"),
        ({"add": {"norm.weight": torch.full((64,), float("nan"))}}, "non-finite"),
    ],
)
def test_broken_weights_are_caught(random_target, tmp_path, mutation, needle):
    path, _ = _ckpt(random_target, tmp_path / "c")
    _break(path, **mutation)
    problems = validate_for_serving(path)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (lambda c: c["dflash_config"].update(mask_token_id=10**9), "mask_token_id"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), "full (non-sliding)"),
        (lambda c: c.update(is_causal=True), "bidirectional"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 99]), "out of range"),
    ],
)
def test_broken_configs_are_caught(random_target, tmp_path, edit, needle):
    path, _ = _ckpt(random_target, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    assert any(needle in p for p in validate_for_serving(path))


def test_unservable_drafters_are_refused(random_target, tmp_path):
    path, _ = _ckpt(random_target, tmp_path / "noqk", qk_norm=False)
    assert any("engines always apply q/k norm" in p for p in validate_for_serving(path))
    cfg = DrafterConfig.for_target(random_target, block_size=4, arch="semi_ar", markov_rank=4)
    semi = save_drafter(SemiARDrafter(cfg).bind_target(random_target), tmp_path / "semi")
    assert any("Markov head" in p for p in validate_for_serving(semi))
    with pytest.raises(ValueError, match="cannot be served: .*Markov head"):
        export_drafter(semi, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (path / "extra.bin").write_bytes(b"x")
    assert any("pickle" in p for p in validate_for_serving(path))


def test_export_casts_and_validates(random_target, tmp_path):
    path, drafter = _ckpt(random_target, tmp_path / "c")
    out = export_drafter(path, tmp_path / "served", dtype=torch.bfloat16)
    assert validate_for_serving(out) == []
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(
        tensors["fc.weight"].float(), drafter.fc.weight, rtol=1e-2, atol=1e-3
    )


def test_reduced_vocab_export_needs_target_head_rows(random_target, tmp_path):
    cfg = DrafterConfig.for_target(random_target, block_size=4, draft_vocab_size=16)
    drafter = BlockDrafter(cfg).bind_target(random_target)
    ids = torch.arange(3, 3 + 16 * 7, 7)
    drafter.set_draft_vocab(ids)
    path = save_drafter(drafter, tmp_path / "c")
    assert any("lm_head.weight" in p for p in validate_for_serving(path))
    with pytest.raises(ValueError, match="export with a target"):
        export_drafter(path, tmp_path / "x")
    out = export_drafter(path, tmp_path / "served", target=random_target)
    assert validate_for_serving(out) == []
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], random_target.lm_head.weight[ids])
    # vLLM reconstructs target ids as arange(N) + d2t
    assert torch.equal(torch.arange(16) + tensors["d2t"], ids)


def test_expand_vocab_scores_the_whole_vocabulary_with_the_same_body(random_target, tmp_path):
    """`expand_vocab` on a reduced-vocabulary DFlash drafter: no d2t and no head rows in the
    export, the same hidden states, logits equal to the trained drafter's on its vocabulary
    and, outside it, the target's head applied to those hidden states (an independent
    matmul), so a token outside the vocabulary can now be proposed."""
    cfg = DrafterConfig.for_target(random_target, block_size=4, draft_vocab_size=16)
    drafter = BlockDrafter(cfg).bind_target(random_target).eval()
    ids = torch.arange(3, 3 + 16 * 7, 7)
    drafter.set_draft_vocab(ids)
    path = save_drafter(drafter, tmp_path / "c")
    out = export_drafter(path, tmp_path / "wide", target=random_target, expand_vocab=True)
    assert validate_for_serving(out) == []
    assert not {"d2t", "lm_head.weight"} & set(load_file(str(out / "model.safetensors")))
    assert "draft_vocab_size" not in json.loads((out / "config.json").read_text())
    wide = load_drafter(out, random_target).eval()
    assert wide.config.draft_vocab_size is None
    tokens = torch.randint(
        0, random_target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3)
    )
    feats = random_target.forward(tokens).features
    anchors = torch.tensor([[0, 5]])
    with torch.no_grad():
        hidden = drafter.forward_blocks(feats, tokens, anchors)
        assert torch.equal(wide.forward_blocks(feats, tokens, anchors), hidden)
        narrow, full = drafter.compute_logits(hidden), wide.compute_logits(hidden)
    torch.testing.assert_close(full[..., ids], narrow[..., ids], rtol=0, atol=1e-6)
    assert torch.isinf(narrow[..., 0]).all()  # token 0 is outside the draft vocabulary
    head = random_target.lm_head.weight.detach().float()
    torch.testing.assert_close(full, hidden.float() @ head.T, rtol=1e-5, atol=1e-5)


def test_cli_export(random_target, tmp_path, capsys):
    from blockdraft.cli import main

    path, _ = _ckpt(random_target, tmp_path / "c")
    assert main(["export", str(path), "--check"]) == 0
    assert main(["export", str(path), "--out", str(tmp_path / "o"), "--dtype", "bfloat16"]) == 0
    assert validate_for_serving(tmp_path / "o") == []
    _break(path, drop="norm.weight")
    assert main(["export", str(path), "--out", str(tmp_path / "o2")]) == 2  # a user error
    assert "missing weight norm.weight" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def _printed_paths(out: str) -> dict[str, list[str]]:
    """{"target": [...], "drafter": [...]}: every model path the printed commands name."""
    import ast
    import shlex

    text = out.replace("\\\n", " ")
    found: dict[str, list[str]] = {"target": [], "drafter": []}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("python -m sglang"):
            args = shlex.split(line)
            found["target"].append(args[args.index("--model-path") + 1])
            found["drafter"].append(args[args.index("--speculative-draft-model-path") + 1])
        elif line.startswith("vllm serve"):
            args = shlex.split(line)
            found["target"].append(args[2])
            spec = json.loads(args[args.index("--speculative-config") + 1])
            found["drafter"].append(spec["model"])
        elif line.startswith("AutoModel.from_pretrained("):
            inner = line[len("AutoModel.from_pretrained(") : line.index(", trust_remote_code")]
            found["drafter"].append(ast.literal_eval(inner))
    return found


@pytest.mark.parametrize("with_target", [False, True])
def test_printed_serve_commands_name_loadable_paths(tmp_path, capsys, monkeypatch, with_target):
    """Every path the printed commands name loads from any directory: the drafter is the
    validated export, the target a model folder (also when it was named by a relative
    path, as the checkpoint records it), and a path with a space survives the shell."""
    from transformers import AutoConfig, AutoTokenizer

    from blockdraft.cli import main
    from blockdraft.targets.registry import load_target
    from clikit import save_local_model, save_random_drafter

    monkeypatch.chdir(tmp_path)
    save_local_model(tmp_path / "my models" / "m")
    target = load_target("my models/m", progress=False)  # recorded as a relative name
    save_random_drafter(target, tmp_path / "ckpt")
    argv = ["export", "ckpt", "--out", "out dir/export"]
    if with_target:
        argv += ["--target", "my models/m"]
    capsys.readouterr()
    assert main(argv) == 0
    paths = _printed_paths(capsys.readouterr().out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # an engine started from another directory
    assert len(paths["target"]) == 2 and len(paths["drafter"]) == 3, paths
    for p in paths["drafter"]:
        assert Path(p).is_absolute() and validate_for_serving(p) == []
    for p in paths["target"]:
        assert Path(p).is_absolute() and (Path(p) / "config.json").is_file()
        AutoConfig.from_pretrained(p)
        AutoTokenizer.from_pretrained(p)
