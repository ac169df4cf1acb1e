from blockdraft.pipeline.stages import Stage, fingerprint


def test_stage_reused_only_with_same_inputs(tmp_path):
    stage = Stage(tmp_path / "s", {"a": 1, "b": [1, 2]})
    assert not stage.is_done()
    stage.finish({"n": 3})
    assert Stage(tmp_path / "s", {"b": [1, 2], "a": 1}).is_done()
    assert Stage(tmp_path / "s", {"b": [1, 2], "a": 1}).outputs() == {"n": 3}
    assert not Stage(tmp_path / "s", {"a": 2, "b": [1, 2]}).is_done()


def test_corrupt_marker_means_not_done(tmp_path):
    stage = Stage(tmp_path, {"x": 1})
    (tmp_path / "stage.json").write_text("{not json")
    assert not stage.is_done()
    assert fingerprint({"x": 1}) != fingerprint({"x": 2})
