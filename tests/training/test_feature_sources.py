"""Cached target features: same step as online, refusals, resumable writer, disk guard."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from trainkit import MAX_NEW_TOKENS, make_config, prompts_for

import blockdraft.data.feature_writer as features_mod
from blockdraft.data.feature_store import FeatureError, FeatureStore, rollout_set_id
from blockdraft.data.feature_writer import plan_features, write_features
from blockdraft.data.rollouts import RolloutSet, SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.store import read_manifest
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.registry import make_objective
from blockdraft.training import train
from blockdraft.training.batching import collate
from blockdraft.training.builders import TrainSetupError
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import (
    CachedFeatures,
    OnlineTargetFeatures,
    build_feature_source,
)
from blockdraft.training.steps import StepInputs
from blockdraft.training.steps.block import block_step
from blockdraft.training.steps.rounds import rounds_step
from random_targets import make_random_target


@pytest.fixture(scope="module")
def feature_dirs(target, rollout_dirs, tmp_path_factory):
    """{float32, bfloat16}: features of the greedy rollout set (shards of 7 rows)."""
    root = tmp_path_factory.mktemp("features")
    out = {}
    for dtype in ("float32", "bfloat16"):
        plan = plan_features(
            target, rollout_dirs["greedy"], root / dtype, dtype=dtype, shard_size=7
        )
        write_features(target, plan, batch_size=3, progress=False)
        out[dtype] = root / dtype
    return out


def _open(target, rollout_dirs, directory, rollouts, max_seq_len=64, **kw):
    return CachedFeatures.open(
        directory,
        target=kw.get("check_target", target),
        rollout_dir=kw.get("rollout_dir", rollout_dirs["greedy"]),
        rollouts=rollouts,
        max_seq_len=max_seq_len,
    )


def test_stored_features_are_the_targets_hidden_states(target, rollout_dirs, feature_dirs):
    """Independent check: each row equals a single-sequence target forward (no padding)."""
    rs = RolloutSet.open(rollout_dirs["greedy"])
    store = FeatureStore(feature_dirs["float32"])
    assert store.num_rows == len(rs) == 24
    assert store.manifest["layer_ids"] == [1] and store.manifest["complete"]
    for row in (0, 6, 7, 23):  # shard edges
        r = rs[row]
        ids = torch.cat([r.prompt_ids, r.response_ids])[None]
        with torch.no_grad():
            hidden = target.model(ids, output_hidden_states=True).hidden_states[2][0]
        torch.testing.assert_close(store.row(row), hidden, rtol=1e-5, atol=1e-5)
        assert store.row_info(row)[0] == r.prompt_id


def _step(source, target, rollouts, settings, objective_name: str):
    """One micro-step (dpace or greedy EDR) with a fixed drafter; (numerator, grads)."""
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=5))
    drafter.bind_target(target)
    fwd = DraftForward(drafter)
    idx = [3, 0, 11, 7, 20]
    batch = collate([rollouts[i] for i in idx], idx, 0, 64)
    if objective_name == "edr":
        obj = make_objective("edr", mode="greedy", max_anchors=8)  # long rows are PPS-sampled
        inputs = StepInputs(
            fwd, drafter, source, obj, settings, stop_token_ids=target.stop_token_ids
        )
        out = rounds_step(inputs, batch, step=2, want_acc=True)
    else:
        obj = make_objective(objective_name, alpha=0.5)
        inputs = StepInputs(fwd, drafter, source, obj, settings, num_anchors=8)
        out = block_step(inputs, batch, step=2, want_acc=True)
    out.numerator.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return out.numerator.detach(), out.denominator, grads


@pytest.mark.parametrize("objective_name", ["dpace", "edr"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_step_equals_online_step(target, rollout_dirs, feature_dirs, dtype, objective_name):
    rs = RolloutSet.open(rollout_dirs["greedy"])
    rollouts = list(rs)
    cached = _open(target, rollout_dirs, feature_dirs[dtype], rollouts)
    n_on, d_on, g_on = _step(
        OnlineTargetFeatures(target), target, rollouts, rs.settings, objective_name
    )
    n_ca, d_ca, g_ca = _step(cached, target, rollouts, rs.settings, objective_name)
    assert d_on > 0
    assert g_on.keys() == g_ca.keys() and len(g_on) > 3
    # float32 storage: bit-identical (right padding and a causal target make each row's
    # features independent of how the writer batched it); bfloat16: the features' rounding
    tol = dict(rtol=0, atol=0) if dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(n_ca, n_on, **tol)
    torch.testing.assert_close(d_ca, d_on, **tol)  # D-PACE's weight sum depends on q
    for name in g_on:
        scale = g_on[name].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(g_ca[name] / scale, g_on[name] / scale, **tol, msg=name)
    if dtype == "bfloat16":  # the rounding is really there (the test could fail)
        assert any(not torch.equal(g_ca[n], g_on[n]) for n in g_on)


def test_train_with_cached_features_matches_online(
    target, rollout_dirs, feature_dirs, tmp_path, monkeypatch
):
    """Whole runs (held-out split by prompt id: batches index a subset of the stored rows)."""
    from safetensors.torch import load_file

    sections = dict(objective={"name": "dpace"}, optim={"max_steps": 4}, eval={"at_start": False})
    a = train(make_config(tmp_path / "on", rollout_dirs, **sections), target=target)
    cfg = make_config(tmp_path / "ca", rollout_dirs, **sections)
    cfg.data.features = str(feature_dirs["float32"])

    def no_target_forward(*args, **kwargs):
        raise AssertionError("the target ran during a cached-features training step")

    monkeypatch.setattr(OnlineTargetFeatures, "features", no_target_forward)
    b = train(cfg, target=target)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k in wa:
        assert torch.equal(wb[k], wa[k]), k


def test_refuses_features_of_another_target_layers_or_rollouts(target, rollout_dirs, feature_dirs):
    rollouts = list(RolloutSet.open(rollout_dirs["greedy"]))
    d = feature_dirs["bfloat16"]
    other = make_random_target("qwen3", hidden_size=64, num_layers=4, seed=1)
    other.layer_ids = [1]
    with pytest.raises(TrainSetupError, match=r"^data\.features: .*computed by target"):
        _open(target, rollout_dirs, d, rollouts, check_target=other)
    relayered = copy.copy(target)
    relayered.layer_ids = [2]
    with pytest.raises(TrainSetupError, match=r"^data\.features: .*target\.layer_ids \[2\]"):
        _open(target, rollout_dirs, d, rollouts, check_target=relayered)
    with pytest.raises(TrainSetupError, match=r"^data\.features: .*another rollout set"):
        _open(target, rollout_dirs, d, rollouts, rollout_dir=rollout_dirs["sampled"])
    with pytest.raises(TrainSetupError, match=r"^data\.max_seq_len: 8 truncates"):
        _open(target, rollout_dirs, d, rollouts, max_seq_len=8)
    with pytest.raises(TrainSetupError, match=r"^data\.features: .* is not a features directory"):
        _open(target, rollout_dirs, rollout_dirs["greedy"].parent, rollouts)


def test_train_refuses_features_of_other_rollouts(target, rollout_dirs, feature_dirs, tmp_path):
    cfg = make_config(tmp_path / "run", rollout_dirs, "sampled")
    cfg.data.features = str(feature_dirs["float32"])
    with pytest.raises(TrainSetupError, match=r"^data\.features: .*another rollout set"):
        train(cfg, target=target)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_train_refuses_damaged_feature_shards(target, rollout_dirs, feature_dirs, tmp_path, damage):
    import shutil

    d = tmp_path / "features"
    shutil.copytree(feature_dirs["float32"], d)
    shard = d / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(
        bytes(data[:300]) if damage == "truncate" else data[:-4] + b"\x7f\x7f\x7f\x7f"
    )
    cfg = make_config(tmp_path / "run", rollout_dirs, optim={"max_steps": 2})
    cfg.data.features = str(d)
    word = "truncated" if damage == "truncate" else "corrupted"
    with pytest.raises(TrainSetupError, match=rf"{shard}: {word}"):  # not trained on, no traceback
        train(cfg, target=target)


def test_objectives_needing_target_distributions_fall_back_online(target, rollout_dirs, tmp_path):
    plan = plan_features(target, rollout_dirs["sampled"], tmp_path / "f", dtype="bfloat16")
    write_features(target, plan, progress=False)
    cfg = make_config(tmp_path / "run", rollout_dirs, "sampled")
    cfg.data.features = str(tmp_path / "f")
    rollouts = list(RolloutSet.open(rollout_dirs["sampled"]))
    data = type("D", (), {"rollouts": rollouts})
    said: list[str] = []
    for name, mode, cached in (
        ("e2e", "sampling", False),
        ("edr", "sampling", False),
        ("dpace", "sampling", True),
        ("e2e", "greedy", True),
    ):
        cfg.objective.name = name
        obj = make_objective(name, **({"mode": mode} if name == "edr" else {}))
        src = build_feature_source(cfg, target, data, obj, mode, say=said.append)
        assert isinstance(src, CachedFeatures) is cached, (name, mode)
    assert len(said) == 2 and all("training online" in s for s in said)
    assert said[0].startswith("data.features: objective 'e2e' on sampling rollouts")


def test_interrupted_writer_resumes_to_identical_shards(
    target, rollout_dirs, tmp_path, monkeypatch
):
    def run(out):
        plan = plan_features(target, rollout_dirs["greedy"], out, dtype="bfloat16", shard_size=5)
        return write_features(target, plan, batch_size=2, progress=False)

    run(tmp_path / "straight")
    real = features_mod._shard_rows
    calls = {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # shards 0 and 1 are listed, shard 2 dies mid-way
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(features_mod, "_shard_rows", crashing)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    monkeypatch.setattr(features_mod, "_shard_rows", real)
    partial = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert [s["rows"] for s in partial["shards"]] == [5, 5] and not partial["complete"]
    plan = plan_features(
        target, rollout_dirs["greedy"], tmp_path / "resumed", dtype="bfloat16", shard_size=5
    )
    assert plan.done_rows == 10 and 0 < plan.remaining_bytes < plan.total_bytes
    stale = tmp_path / "resumed" / ".shard-00002.safetensors.tmp"  # what kill -9 leaves
    stale.write_bytes(b"half a shard")
    run(tmp_path / "resumed")
    assert not stale.exists()
    a = json.loads((tmp_path / "straight" / "manifest.json").read_text())
    b = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert a["shards"] == b["shards"] and b["complete"] and len(b["shards"]) == 5
    for s in a["shards"]:
        assert (tmp_path / "straight" / s["file"]).read_bytes() == (
            tmp_path / "resumed" / s["file"]
        ).read_bytes()
    with pytest.raises(FeatureError, match=r"refusing to mix features: dtype differs"):
        plan_features(
            target, rollout_dirs["greedy"], tmp_path / "resumed", dtype="float32", shard_size=5
        )


def test_disk_formula_and_max_gb_guard(target, rollout_dirs, tmp_path, monkeypatch, capsys):
    import blockdraft.cli.features as features_cli
    from blockdraft.cli import main

    rs = RolloutSet.open(rollout_dirs["greedy"])
    tokens = sum(r.prompt_len + r.response_len for r in rs)
    plan = plan_features(target, rollout_dirs["greedy"], tmp_path / "x", dtype="bfloat16")
    assert plan.num_tokens == tokens
    assert plan.total_bytes == tokens * 1 * 64 * 2  # tokens x layers x hidden x bytes
    monkeypatch.setattr(features_cli, "load_target", lambda *a, **k: target)
    argv = ["features", "--target", "t", "--rollouts", str(rollout_dirs["greedy"]), "--no-progress"]
    code = main(argv + ["--out", str(tmp_path / "x"), "--max-gb", "1e-6"])
    out, err = capsys.readouterr()
    assert code == 2 and f"{tokens} tokens x 64 features" in out
    assert err.startswith("error: --max-gb: the features would take") and "pass --max-gb" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    assert main(argv + ["--out", str(tmp_path / "y"), "--store-dtype", "float32"]) == 0
    assert FeatureStore(tmp_path / "y").manifest["num_tokens"] == tokens


def test_a_grown_rollout_set_extends_its_features(target, tmp_path, monkeypatch):
    """Rollouts extended by more prompts: only the new rows are computed, and the directory
    holds what a fresh run on the grown set holds, row for row; another set is refused."""
    settings = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, seed=1)

    def rollouts(name, n, prefix="g"):
        d = tmp_path / name
        prompts = prompts_for(prefix, n)
        generate_rollouts(target, prompts, d, settings, batch_size=4, progress=False)
        return d

    def features(rdir, out):
        plan = plan_features(target, rdir, out, dtype="float32", shard_size=4)
        return plan, write_features(target, plan, batch_size=3, progress=False)

    grown = rollouts("grown", 10)
    features(grown, tmp_path / "f")
    rollouts("grown", 17)  # the same directory, extended
    computed = []
    real = features_mod._shard_rows

    def counting(t, p, lo, hi, *args):
        computed.append(lo)
        return real(t, p, lo, hi, *args)

    monkeypatch.setattr(features_mod, "_shard_rows", counting)
    plan, store = features(grown, tmp_path / "f")
    assert plan.done_rows == 10 and min(computed) == 10
    monkeypatch.setattr(features_mod, "_shard_rows", real)
    _, fresh = features(rollouts("fresh", 17), tmp_path / "f-fresh")
    assert store.num_rows == fresh.num_rows == 17 and store.manifest["complete"]
    assert store.manifest["rollouts"]["set_id"] == rollout_set_id(read_manifest(grown))
    for row in range(17):
        torch.testing.assert_close(store.row(row), fresh.row(row), rtol=0, atol=0)
        assert store.row_info(row) == fresh.row_info(row)
    rs = list(RolloutSet.open(grown))
    CachedFeatures.open(  # training accepts the extended directory for the grown set
        tmp_path / "f", target=target, rollout_dir=grown, rollouts=rs, max_seq_len=64
    )
    other = rollouts("other", 20, prefix="h")  # larger, but its first rows are other rollouts
    with pytest.raises(FeatureError, match=r"computed from another rollout set .* not the first"):
        plan_features(target, other, tmp_path / "f", dtype="float32", shard_size=4)
