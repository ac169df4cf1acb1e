"""`export --format gguf` says what llama.cpp cannot serve before it writes anything (these
run without llama.cpp built; tests/engines/test_llamacpp_serving.py serves the GGUFs)."""

from __future__ import annotations

from blockdraft.drafters.config import DrafterConfig
from blockdraft.drafters.dflash import BlockDrafter
from blockdraft.serialization.checkpoint import save_drafter
from blockdraft.targets.registry import load_target
from clikit import one_line_error, run_cli


def test_a_reduced_draft_vocabulary_is_refused_before_the_export(tmp_path, capsys):
    tiny = load_target("tiny", progress=False)
    cfg = DrafterConfig.for_target(tiny, block_size=4, draft_vocab_size=512)
    ckpt = save_drafter(BlockDrafter(cfg).bind_target(tiny), tmp_path / "ckpt")
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "export", ckpt, "--out", out, "--format", "gguf", "--target", "tiny"
    )
    assert code == 2
    assert "draft vocabulary (512 tokens)" in one_line_error(err)
    assert not out.exists()  # said up front: nothing written


def test_gguf_needs_the_target(tmp_path, capsys):
    tiny = load_target("tiny", progress=False)
    ckpt = save_drafter(
        BlockDrafter(DrafterConfig.for_target(tiny, block_size=4)).bind_target(tiny),
        tmp_path / "ckpt",
    )
    code, _, err = run_cli(capsys, "export", ckpt, "--out", tmp_path / "out", "--format", "gguf")
    assert code == 2 and "--target" in one_line_error(err)
    assert not (tmp_path / "out").exists()
