"""JSON written for other tools (eval/compare --json, the demo's report.json) is strict:
Python's bare NaN is not JSON and breaks jq, JavaScript and most other parsers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from blockdraft.cli.eval import write_json


def _strict_load(text: str):
    def reject(constant: str):
        raise AssertionError(f"non-JSON constant {constant} in output")

    return json.loads(text, parse_constant=reject)


def test_nan_and_inf_become_null_and_scalars_become_numbers(tmp_path):
    obj = {
        "ar_k": [0.5, math.nan, math.inf],
        "nested": {"x": (1, -math.inf)},
        "torch": torch.tensor(2.5),
        "numpy": np.float64(0.25),
        "name": "nan",  # strings stay strings
    }
    path = tmp_path / "sub" / "out.json"
    write_json(path, obj)
    back = _strict_load(path.read_text())
    assert back == {
        "ar_k": [0.5, None, None],
        "nested": {"x": [1, None]},
        "torch": 2.5,
        "numpy": 0.25,
        "name": "nan",
    }


def test_unserialisable_objects_still_fail_loudly(tmp_path):
    with pytest.raises(TypeError):
        write_json(tmp_path / "bad.json", {"x": object()})
