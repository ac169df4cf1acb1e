"""A manifest names files inside its own directory and nowhere else: an entry such as
`../../../etc/passwd` or an absolute path is refused before anything is opened, in one
line naming the manifest and the entry (rollout sets, their part files, feature sets).

The files the bad entries point at are byte-for-byte copies of real shards, so a reader
that followed them would pass every size and SHA-256 check and use them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blockdraft.data.feature_store import FeatureError, FeatureStore
from blockdraft.data.feature_writer import plan_features, write_features
from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.store import RolloutError, RolloutSet
from clikit import make_rollouts, one_line_error, prompts, run_cli, save_local_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from blockdraft.targets.registry import load_target

    root = tmp_path_factory.mktemp("paths")
    model = save_local_model(root / "model")
    target = load_target(str(model), progress=False)
    rollouts = make_rollouts(target, root / "rollouts", n=4, shard_size=2)
    write_features(target, plan_features(target, rollouts, root / "features"), progress=False)
    return {"model": model, "target": target, "rollouts": rollouts, "features": root / "features"}


def _escape_to(where: Path, d: Path, first: str, kind: str) -> str:
    """A name for `d/first`'s copy outside `d`: relative (`../..`) or absolute."""
    outside = where / "outside" / "deeper"
    outside.mkdir(parents=True)
    shutil.copy(d / first, outside / first)
    if kind == "absolute":
        return str(outside / first)
    return (
        f"../outside/deeper/{first}" if kind == "relative" else f"sub/../../outside/deeper/{first}"
    )


def _point_outside(src: Path, tmp_path: Path, kind: str) -> tuple[Path, str]:
    d = tmp_path / "set"
    shutil.copytree(src, d)
    manifest = json.loads((d / "manifest.json").read_text())
    name = _escape_to(tmp_path, d, manifest["shards"][0]["file"], kind)
    manifest["shards"][0]["file"] = name
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d, name


KINDS = ["relative", "absolute", "dotted"]


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_manifest_entry_outside_its_directory_is_refused(setup, tmp_path, capsys, kind):
    d, name = _point_outside(setup["rollouts"], tmp_path, kind)
    with pytest.raises(RolloutError, match=rf"{d / 'manifest.json'}: .*{name!r}"):
        RolloutSet.open(d)
    code, _, err = run_cli(
        capsys, "eval", "--target", setup["model"], "--rollouts", d, "ngram", "--no-progress"
    )
    line = one_line_error(err)
    assert code == 2 and str(d / "manifest.json") in line and name in line
    with pytest.raises(RolloutError, match=rf"{name!r}"):  # resuming the set: refused too
        generate_rollouts(
            setup["target"], prompts(4), d,
            SamplingSettings(temperature=0.0, max_new_tokens=8, seed=0),
            shard_size=2, batch_size=4, progress=False,
        )  # fmt: skip


def test_part_file_entry_outside_the_directory_is_refused(setup, tmp_path):
    d = tmp_path / "set"
    shutil.copytree(setup["rollouts"], d)
    manifest = json.loads((d / "manifest.json").read_text())
    last = manifest["shards"].pop()
    manifest.update(num_rollouts=last["first_row"], complete=False)
    (d / "manifest.json").write_text(json.dumps(manifest))
    name = _escape_to(tmp_path, d, last["file"], "relative")
    part = d / "manifest.rank-00000.json"
    part.write_text(json.dumps({"rank": 0, "shards": [{**last, "file": name}]}))
    with pytest.raises(RolloutError, match=rf"{part}: .*{name!r}"):
        generate_rollouts(
            setup["target"], prompts(4), d,
            SamplingSettings(temperature=0.0, max_new_tokens=8, seed=0),
            shard_size=2, batch_size=4, progress=False,
        )  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_feature_manifest_entry_outside_its_directory_is_refused(setup, tmp_path, kind):
    d, name = _point_outside(setup["features"], tmp_path, kind)
    with pytest.raises(FeatureError, match=rf"{d / 'manifest.json'}: .*{name!r}"):
        FeatureStore(d)
    with pytest.raises(FeatureError, match=rf"{name!r}"):  # resuming the set: refused too
        plan_features(setup["target"], setup["rollouts"], d)


def test_plain_names_still_read(setup):
    assert len(RolloutSet.open(setup["rollouts"])) == 4
    assert FeatureStore(setup["features"]).num_rows == 4


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda m: m["shards"][-1].update(rows=m["shards"][-1]["rows"] + 1), "holds 4 rows"),
        (lambda m: m["shards"][0].update(first_row=1), "'first_row' is 1"),
        (lambda m: m["shards"][0].update(rows="4"), "'rows'"),
    ],
)
def test_edited_feature_manifest_is_one_line(setup, tmp_path, edit, says):
    d = tmp_path / "f"
    shutil.copytree(setup["features"], d)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureError, match=says):
        store = FeatureStore(d)
        store.row_info(store.num_rows - 1)
