"""Lookup-aware exports: `lookup_inputs` drafters, `hybrid` and `trim` specs carry the
lookups their blocks read and where they end under `blockdraft.serving`, named so that
only blockdraft's plugin serves them; anything that would let an engine serve another
drafter is refused."""

from __future__ import annotations

import json

import pytest

from blockdraft.cli import main
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.ngram import NgramConfig
from blockdraft.errors import CheckpointError
from blockdraft.serialization.checkpoint import read_config, save_drafter
from blockdraft.serialization.export import ExportError, export_drafter, validate_for_serving
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE, ServingRules


def _ckpt(target, path, **kw):
    config = DrafterConfig.for_target(target, num_layers=1, block_size=6, **kw)
    return save_drafter(BlockDrafter(config).bind_target(target), path)


def _rewrite(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_lookup_inputs_export_names_the_plugin_and_its_training_rule(random_target, tmp_path):
    ckpt = _ckpt(random_target, tmp_path / "c", lookup_inputs=True)
    # the checkpoint is named so that no engine serves it with MASK in its slots ...
    assert read_config(ckpt)["architectures"] == [LOOKUP_ARCHITECTURE]
    assert any("MASK" in p for p in validate_for_serving(ckpt))
    out = export_drafter(ckpt, tmp_path / "out")
    cfg = read_config(out)
    assert cfg["architectures"] == [LOOKUP_ARCHITECTURE]
    # ... and its export carries the lookup it was trained with: K = 5, latest occurrence
    assert cfg["blockdraft"]["serving"] == {
        "lookup_inputs": {"k": 5, "max": 3, "min": 1, "match": "latest"}
    }
    assert validate_for_serving(out) == []


def test_hybrid_export_carries_its_threshold_and_vllms_lookup(random_target, tmp_path):
    ckpt = _ckpt(random_target, tmp_path / "c")
    plain = export_drafter(ckpt, tmp_path / "plain")
    assert read_config(plain)["architectures"] == ["DFlashDraftModel"]
    assert "serving" not in read_config(plain)["blockdraft"]
    out = export_drafter(ckpt, tmp_path / "hybrid", hybrid_conf=0.25)
    cfg = read_config(out)
    assert cfg["architectures"] == [LOOKUP_ARCHITECTURE]
    serving = ServingRules.read(cfg["blockdraft"], "x")
    assert serving == ServingRules(None, 0.25, NgramConfig(5, 3, 1, "first"))
    assert validate_for_serving(out) == []


def test_trim_export_carries_its_threshold(random_target, tmp_path):
    ckpt = _ckpt(random_target, tmp_path / "c", lookup_inputs=True)
    out = export_drafter(ckpt, tmp_path / "trim", trim_conf=0.35)
    cfg = read_config(out)
    assert cfg["architectures"] == [LOOKUP_ARCHITECTURE]
    assert cfg["blockdraft"]["serving"]["trim"] == {"conf": 0.35}
    assert ServingRules.read(cfg["blockdraft"], "x") == ServingRules(
        NgramConfig(5, 3, 1, "latest"), None, None, 0.35
    )
    assert validate_for_serving(out) == []
    with pytest.raises(ExportError, match="not both"):
        export_drafter(ckpt, tmp_path / "both", hybrid_conf=0.3, trim_conf=0.3)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # renamed to the plain class: an engine without the plugin would serve it silently
        (lambda c: c.update(architectures=["DFlashDraftModel"]), "refuse"),
        # another rule than training's
        (
            lambda c: c["blockdraft"]["serving"]["lookup_inputs"].update(match="first"),
            "trained with",
        ),
        (lambda c: c["blockdraft"].pop("serving"), "MASK"),
        (lambda c: c["blockdraft"]["serving"].update(hybrid={"conf": 2}), "hybrid"),
        (lambda c: c["blockdraft"]["serving"].update(trim={"conf": "high"}), "trim.conf"),
        (lambda c: c["blockdraft"]["serving"].update(trim={"min": 0.3}), "trim"),
    ],
)
def test_tampered_lookup_exports_are_refused(random_target, tmp_path, change, words):
    out = export_drafter(_ckpt(random_target, tmp_path / "c", lookup_inputs=True), tmp_path / "o")
    _rewrite(out, change)
    problems = validate_for_serving(out)
    assert any(words in p for p in problems), problems


def test_a_bad_section_is_one_line_naming_the_key():
    bad = {"serving": {"hybrid": {"conf": 1.5, "lookup": {}}}}
    with pytest.raises(CheckpointError, match=r"f\.json: blockdraft\.serving\.hybrid\.conf"):
        ServingRules.read(bad, "f.json")
    rule = {"k": 0, "max": 3, "min": 1, "match": "first"}
    with pytest.raises(CheckpointError, match=r"lookup_inputs: ngram drafter: k must be"):
        ServingRules.read({"serving": {"lookup_inputs": rule}}, "f.json")


def test_cli_exports_a_hybrid_spec_and_prints_a_plugin_command(random_target, tmp_path, capsys):
    ckpt = _ckpt(random_target, tmp_path / "c")
    code = main(["export", f"hybrid:conf=0.4:{ckpt}", "--out", str(tmp_path / "o")])
    printed = capsys.readouterr().out
    assert code == 0
    assert read_config(tmp_path / "o")["blockdraft"]["serving"]["hybrid"]["conf"] == 0.4
    assert "--no-async-scheduling" in printed and "blockdraft installed beside vLLM" in printed
    assert "SGLang: not servable" in printed
