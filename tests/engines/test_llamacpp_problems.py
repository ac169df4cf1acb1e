"""What llama.cpp's draft-dflash cannot load is said before anything is converted: one line
each (these run without llama.cpp built)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from blockdraft.engines import llamacpp_gguf
from blockdraft.engines.interface import EngineError
from blockdraft.engines.llamacpp_gguf import llamacpp_problem


def _drafter(**over):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 128,
        "vocab_size": 4096,
        "dflash_config": {"mask_token_id": 2, "target_layer_ids": [0, 2], "block_size": 8},
    }
    cfg.update(over)
    return cfg


QWEN = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=128, num_hidden_layers=4)
LLAMA = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=128, num_hidden_layers=4)


def test_llama_and_qwen3_targets_of_the_drafters_width_are_served():
    assert llamacpp_problem(_drafter(), QWEN) is None
    assert llamacpp_problem(_drafter(), LLAMA) is None


@pytest.mark.parametrize(
    ("drafter", "target", "says"),
    [
        (_drafter(), Gemma3TextConfig(architectures=["Gemma3ForCausalLM"]), "Gemma3ForCausalLM"),
        (_drafter(hidden_size=64, target_hidden_size=128), QWEN, "hidden size (64)"),
        (
            _drafter(draft_vocab_size=512),
            QWEN,
            "(512 tokens) cannot be served by llama.cpp: export it with --expand-vocab",
        ),  # fmt: skip
        (_drafter(architectures=["DFlashLookupDraftModel"]), QWEN, "lookup-aware"),
        (_drafter(architectures=["DFlash2DraftModel"]), QWEN, "DFlash2"),
        (_drafter(dflash_config={"target_layer_ids": [0]}), QWEN, "mask_token_id"),
        (_drafter(dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 2}), QWEN, "layer 3"),
    ],
)
def test_what_llamacpp_cannot_load_is_one_line(drafter, target, says):
    problem = llamacpp_problem(drafter, target)
    assert problem is not None and says in problem and "\n" not in problem


def test_missing_tools_name_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp_gguf.TOOLS_ENV, str(tmp_path))
    with pytest.raises(EngineError, match="make engine-llamacpp"):
        llamacpp_gguf.require_tools()
    with pytest.raises(EngineError, match="make engine-llamacpp"):
        llamacpp_gguf.convert_to_gguf(tmp_path, tmp_path / "x.gguf")


def test_gpt2_split_is_recognised_from_tokenizer_json(tmp_path):
    """Only a ByteLevel pre-tokenizer with GPT-2's regex and no normalizer counts."""
    import json

    def write(tok):
        (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
        return llamacpp_gguf._byte_level_gpt2(tmp_path)

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert write({"model": {"type": "BPE"}, "normalizer": None, "pre_tokenizer": byte_level})
    assert not write({"model": {"type": "BPE"}, "normalizer": {"type": "NFC"},
                      "pre_tokenizer": byte_level})  # fmt: skip
    assert not write({"model": {"type": "BPE"}, "normalizer": None,
                      "pre_tokenizer": {"type": "Metaspace"}})  # fmt: skip
    assert not write({"model": {"type": "Unigram"}, "normalizer": None,
                      "pre_tokenizer": byte_level})  # fmt: skip


def test_rounds_and_proposals_are_read_from_the_servers_log(tmp_path):
    """The counters come from llama-server's per-round lines, by slot, and a partly
    written last line waits for the next read (the server logs from its own thread)."""
    import threading

    from blockdraft.engines.llamacpp_engine import LlamaCppEngine, LlamaServer

    log = tmp_path / "server.log"
    lines = [
        "slot update_slots: id  0 | task 4 | accepted  3/ 7 draft tokens\n",
        "draft:  - seq_id 1, draft candidate   0, pos   0:    17 (   0.900) 'a'\n",
        "draft:  - seq_id 1, draft candidate   1, pos   0:    18 (   0.050) 'b'\n",
        "draft:  - seq_id 1, draft candidate   0, pos   1:    19 (   0.800) '\n",
        "'\n",
        "slot update_slots: id  1 | task 5 | accepted  0/ 2 draft tokens\n",
        "slot update_slots: id  0 | task 6 | accepted  7/ 7 draft tok",
    ]
    log.write_text("".join(lines))
    server = object.__new__(LlamaServer)
    server.log_path, server._read_at, server._rounds, server.proposals = log, 0, {}, {}
    server._lock = threading.Lock()
    engine = object.__new__(LlamaCppEngine)
    engine.server, engine.num_proposals, engine._counted = server, 7, {}
    c = engine.counters()
    assert (c.drafts, c.draft_tokens, c.accepted) == (2, 9, 3)
    assert c.accepted_per_position == [1, 1, 1, 0, 0, 0, 0]
    assert engine.take_drafts() == [([], [[17, 19]])]
    with open(log, "a") as f:
        f.write("ens\n")
    c = engine.counters()
    assert (c.drafts, c.accepted) == (3, 10) and c.accepted_per_position == [2] * 3 + [1] * 4
    assert engine.take_drafts() == []


def test_export_checks_the_config_the_export_will_have(tmp_path, capsys, monkeypatch):
    """`export --format gguf` refuses a reduced vocabulary (naming --expand-vocab) and a
    hybrid (lookup-aware once exported), and with --expand-vocab goes past the vocabulary
    rule: the refusal it reaches without llama.cpp built is the missing build, not d2t.
    Nothing is written on any refusal."""
    from blockdraft.cli import main
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.serialization.checkpoint import save_drafter
    from blockdraft.targets.registry import load_target

    tiny = load_target("tiny", progress=False)
    drafter = BlockDrafter(DrafterConfig.for_target(tiny, block_size=4, draft_vocab_size=64))
    drafter.bind_target(tiny).set_draft_vocab(torch.arange(64))
    ckpt = save_drafter(drafter, tmp_path / "c")
    base = ["export", "--format", "gguf", "--target", "tiny", "--out"]

    def refused(*args: str) -> str:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        assert main([*base, str(out), *args]) == 2
        assert not out.exists()
        return capsys.readouterr().err

    assert "export it with --expand-vocab" in refused(str(ckpt))
    assert "lookup-aware" in refused(f"hybrid:{ckpt}", "--expand-vocab")
    monkeypatch.setenv(llamacpp_gguf.TOOLS_ENV, str(tmp_path / "no-build"))
    err = refused(str(ckpt), "--expand-vocab")
    assert "make engine-llamacpp" in err and "d2t" not in err
