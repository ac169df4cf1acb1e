"""The embedded `tiny` target: deterministic, cached, atomic, and it actually learns.

All builds use `TinyConfig.micro()` (seconds) through the same code path as the real one.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.targets import tiny
from blockdraft.targets.tiny import TinyConfig, build_tiny_target, load_tiny_target, read_manifest
from blockdraft.targets.tiny_corpus import load_corpus, pack_documents
from blockdraft.targets.tokenizer import EOS_TOKEN, MASK_TOKEN
from blockdraft.user_cache import CACHE_ENV, cache_root, targets_dir

MICRO = TinyConfig.micro(seed=0)


@pytest.fixture(scope="session")
def micro_build(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny-cache")
    return cache, build_tiny_target(MICRO, cache_dir=cache, progress=False)


def _weights(path):
    return load_file(path / "model.safetensors")


def test_same_seed_gives_identical_model(micro_build, tmp_path):
    _, first = micro_build
    second = build_tiny_target(MICRO, cache_dir=tmp_path, progress=False)
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()


def test_different_seed_gives_different_model(micro_build, tmp_path):
    _, first = micro_build
    other = build_tiny_target(TinyConfig.micro(seed=1), cache_dir=tmp_path, progress=False)
    assert other.name != first.name  # the seed is part of the cache key
    a, b = _weights(first), _weights(other)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_cache_is_reused_without_retraining(micro_build, monkeypatch):
    cache, path = micro_build
    mtime = (path / tiny.MANIFEST).stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached build was retrained")

    monkeypatch.setattr(tiny, "_train", no_training)
    assert build_tiny_target(MICRO, cache_dir=cache, progress=False) == path
    target = load_tiny_target(MICRO, cache_dir=cache, progress=False)
    assert (path / tiny.MANIFEST).stat().st_mtime_ns == mtime
    assert target.name == "tiny"
    assert target.mask_token_id == target.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert target.stop_token_ids == [target.tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    out = target.forward(torch.tensor([target.encode("import os\n")]))
    assert out.logits.shape[-1] == target.vocab_size


def test_interrupted_build_leaves_no_cache_entry(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def interrupt_after_two(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_target(TinyConfig.micro(seed=7), cache_dir=tmp_path, progress=False)
    assert calls["n"] == 3
    assert list(targets_dir(tmp_path).iterdir()) == []  # no entry, no temp dir left


def test_micro_model_learns(micro_build):
    _, path = micro_build
    m = read_manifest(path)
    assert m["final_heldout_loss"] < m["initial_heldout_loss"] - 0.5
    assert m["seed"] == 0 and m["config"]["steps"] == MICRO.steps
    assert set(m["corpus"]["heldout_files"]).isdisjoint(m["corpus"]["train_files"])
    for key in ("python_version", "blockdraft_version", "final_train_loss", "cache_key"):
        assert key in m


def test_config_change_changes_cache_key(tmp_path):
    a = tiny.tiny_target_path(MICRO, cache_dir=tmp_path)
    b = tiny.tiny_target_path(TinyConfig.micro(lr=5e-3), cache_dir=tmp_path)
    assert a != b and a == tiny.tiny_target_path(TinyConfig.micro(), cache_dir=tmp_path)


def test_corpus_is_deterministic_and_documents_end_with_eos(random_target):
    a, b = load_corpus(40_000, 4), load_corpus(40_000, 4)
    assert a.train_files == b.train_files and a.digest == b.digest
    assert a.train_files == sorted(a.train_files) and a.heldout_files
    tok = random_target.tokenizer
    eos = tok.eos_token_id
    stream = pack_documents(tok, ["x = 1\n", "y = 2\n"], eos)
    assert stream[-1].item() == eos and (stream == eos).sum().item() == 2


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "blockdraft"


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="precision"):
        build_tiny_target(TinyConfig.micro(precision="fp8"), cache_dir=tmp_path)


@pytest.mark.slow
def test_thread_count_does_not_change_the_micro_model(micro_build, tmp_path):
    """The micro build's products are too small for MKL to split, so 1 and 2 threads agree
    bit for bit; the default build's are not (its last bits move: research/results.md), which
    is why the default ships and the thread count is recorded in every manifest."""
    _, one = micro_build  # built with build_threads(), which may be 1 or 2
    two = build_tiny_target(MICRO, cache_dir=tmp_path / "a", progress=False, num_threads=2)
    single = build_tiny_target(MICRO, cache_dir=tmp_path / "b", progress=False, num_threads=1)
    a, b, c = _weights(single), _weights(two), _weights(one)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_killed_build_leftovers_are_purged(tmp_path):
    import os

    from blockdraft.user_cache import purge_stale_builds

    dead = tmp_path / ".tmp-tiny-abc-999999999-x1"  # pid that cannot exist
    alive = tmp_path / f".tmp-tiny-abc-{os.getpid()}-x2"  # a build still running
    dead.mkdir(), alive.mkdir()
    purge_stale_builds(tmp_path / "tiny-abc")
    assert not dead.exists() and alive.exists()


def test_build_threads_stays_within_torch_threads():
    import torch

    from blockdraft.targets.tiny import build_threads

    n = build_threads(window_s=0.05)
    assert 1 <= n <= torch.get_num_threads()


def test_bench_shape_of_tiny_matches_tiny_config():
    """Benches time `make_shaped_target("tiny")`: it must stay the shape `tiny` is built at."""
    from random_targets import SHAPES, make_shaped_target

    c, (_, fields) = TinyConfig(), SHAPES["tiny"]
    assert (fields["vocab_size"], fields["hidden_size"], fields["num_hidden_layers"]) == (
        c.vocab_size,
        c.hidden_size,
        c.num_layers,
    )
    assert (fields["num_attention_heads"], fields["num_key_value_heads"]) == (
        c.num_heads,
        c.num_kv_heads,
    )
    assert fields["intermediate_size"] == c.intermediate_size
    target = make_shaped_target("tiny")
    assert (target.vocab_size, target.num_layers, target.hidden_size) == (4096, 4, 128)


# --- the shipped default build ---------------------------------------------------------
def test_shipped_weights_are_todays_default_config():
    """Changing TinyConfig's defaults without re-shipping (scripts/ship_tiny.py) must fail
    here, not silently fall back to a minutes-long build on every user's machine."""
    from dataclasses import asdict

    assert tiny.shipped_tiny_path() == tiny.SHIPPED_DIR
    manifest = read_manifest(tiny.SHIPPED_DIR)
    assert manifest["config"] == asdict(TinyConfig())
    assert manifest["precision_used"] == "fp32"
    tiny.verify_shipped()  # every shipped file matches SHA256SUMS
    assert tiny.tiny_target_path() == tiny.SHIPPED_DIR
    assert tiny.tiny_target_path(TinyConfig()) != tiny.SHIPPED_DIR  # explicit: the local build


def test_default_tiny_loads_the_shipped_weights_without_building(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the default tiny target was built instead of loaded")

    monkeypatch.setattr(tiny, "build_tiny_target", no_build)
    target = load_tiny_target(progress=False)
    shipped = _weights(tiny.SHIPPED_DIR)
    state = target.model.state_dict()
    for name, tensor in shipped.items():
        assert torch.equal(state[name], tensor), name
    assert target.tokenizer.convert_ids_to_tokens(target.mask_token_id) == MASK_TOKEN
    assert (
        sum(p.numel() for p in target.model.parameters())
        == read_manifest(tiny.SHIPPED_DIR)["num_parameters"]
    )


def test_verify_shipped_names_a_changed_or_missing_file(tmp_path):
    import shutil

    from blockdraft.errors import BlockdraftError

    copy = tmp_path / "tiny_weights"
    shutil.copytree(tiny.SHIPPED_DIR, copy)
    tiny.verify_shipped(copy)
    data = bytearray((copy / "config.json").read_bytes())
    data[-2] ^= 1
    (copy / "config.json").write_bytes(bytes(data))
    with pytest.raises(BlockdraftError, match=r"config\.json: sha256"):
        tiny.verify_shipped(copy)
    (copy / "config.json").unlink()
    with pytest.raises(BlockdraftError, match=r"config\.json: sha256 missing"):
        tiny.verify_shipped(copy)
    (copy / tiny.CHECKSUMS).unlink()
    with pytest.raises(BlockdraftError, match="SHA256SUMS: missing"):
        tiny.verify_shipped(copy)


def test_write_checksums_round_trips_a_build(micro_build, tmp_path):
    import shutil

    _, path = micro_build
    copy = tmp_path / "build"
    shutil.copytree(path, copy)
    tiny.write_checksums(copy)
    names = [line.split("  ")[1] for line in (copy / tiny.CHECKSUMS).read_text().splitlines()]
    assert "model.safetensors" in names and tiny.MANIFEST in names
    tiny.verify_shipped(copy)
