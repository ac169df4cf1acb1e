"""Target registry: HF local paths, mask-token choice, clear errors, fingerprints."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from blockdraft.targets import tiny
from blockdraft.targets.fingerprint import target_fingerprint
from blockdraft.targets.hf_target import choose_mask_token_id
from blockdraft.targets.registry import list_targets, load_target
from blockdraft.targets.tokenizer import MASK_TOKEN
from random_targets import make_random_target


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def saved_random(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-qwen3")
    t = make_random_target("qwen3", num_layers=6)
    t.model.save_pretrained(path)
    t.tokenizer.save_pretrained(path)
    return path


def _no_mask_model(path):
    """A model whose tokenizer has no mask token, no reserved token and no spare rows."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["def f(x):\n    return x\n"] * 5,
        trainers.BpeTrainer(
            vocab_size=280,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    cfg = Qwen3Config(
        vocab_size=len(hf_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        eos_token_id=hf_tok.eos_token_id,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


def test_local_path_loads_with_its_mask_token(saved_random):
    target = load_target(str(saved_random), num_feature_layers=3)
    assert target.mask_token_id == target.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert len(target.layer_ids) == 3 and target.layer_ids == sorted(target.layer_ids)
    assert load_target(str(saved_random), layer_ids=[0, 2]).layer_ids == [0, 2]


def test_unknown_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_target(str(tmp_path / "nope"))


def test_uncached_hub_id_does_not_download():
    with pytest.raises(FileNotFoundError, match="allow_download"):
        load_target("someone/not-a-cached-model")


def test_missing_mask_token_is_a_clear_error_and_flag_fixes_it(tmp_path):
    path = _no_mask_model(tmp_path / "nomask")
    with pytest.raises(ValueError, match="--mask-token"):
        load_target(str(path))
    target = load_target(str(path), mask_token="<eos>")
    assert target.mask_token_id == target.tokenizer.convert_tokens_to_ids("<eos>")
    with pytest.raises(ValueError, match="not a single token"):
        load_target(str(path), mask_token="<no such token>")


def test_mask_token_detection_order():
    vocab = {"a": 0, "<eos>": 1, "<unused3>": 9, "<unused0>": 7}
    tok = type(
        "T",
        (),
        {"mask_token": None, "get_vocab": lambda self: vocab, "__len__": lambda self: len(vocab)},
    )()
    assert choose_mask_token_id(tok, 10) == 7  # lowest id among reserved tokens
    assert choose_mask_token_id(tok, 10, mask_token="a") == 0  # explicit wins
    plain = {"a": 0, "b": 1}
    tok2 = type(
        "T", (), {"mask_token": None, "get_vocab": lambda self: plain, "__len__": lambda self: 2}
    )()
    assert choose_mask_token_id(tok2, 8) == 2  # padded embedding rows beyond the tokenizer
    assert choose_mask_token_id(tok2, 2) is None


def test_fingerprint_is_stable_and_tells_targets_apart(saved_random):
    a = load_target(str(saved_random))
    b = load_target(str(saved_random), dtype=torch.bfloat16)
    assert target_fingerprint(a) == target_fingerprint(b)
    other_seed = make_random_target("qwen3", num_layers=6, seed=1)
    assert target_fingerprint(other_seed) != target_fingerprint(a)
    other_arch = make_random_target("llama", num_layers=6)
    assert target_fingerprint(other_arch) != target_fingerprint(a)


def test_list_targets_names():
    names = {t["name"]: t for t in list_targets()}
    assert set(names) == {"tiny", "gemma-3-270m", "smollm2-135m"}
    assert names["tiny"]["ready"] is True  # shipped weights, even with a fresh cache dir
    assert names["tiny"]["path"] == str(tiny.SHIPPED_DIR)


def test_cli_info_and_sample_on_a_local_path(saved_random, capsys):
    import json

    from blockdraft.cli import main

    assert main(["target", "info", str(saved_random)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["mask_token"][1] == MASK_TOKEN and len(info["fingerprint"]) == 32
    args = ["target", "sample", str(saved_random), "--prompt", "def ", "--max-new-tokens", "5"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["target", "build", str(saved_random)]) == 2  # only named targets are built


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_features_without_logits_match_the_full_forward(arch):
    """Training forwards skip the LM head; the features must be the very same tensors'
    values as in the full forward, with and without padding."""
    target = make_random_target(arch, seed=3)
    ids = torch.randint(0, target.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding, as in training batches
    full = target.forward(ids, attention_mask=mask)
    lean = target.forward(ids, attention_mask=mask, with_logits=False)
    assert full.logits is not None and lean.logits is None
    assert torch.equal(full.features, lean.features)
    with pytest.raises(ValueError, match="training forwards"):
        target.forward(ids, use_cache=True, with_logits=False)
