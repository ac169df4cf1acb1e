"""What eval/compare write for people and tools: strict JSON (eval/compare --json, the
demo's report.json; Python's bare NaN breaks jq, JavaScript and most other parsers) and
benchmark names that say which prompts a rollout set holds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from blockdraft.evaluation.eval_compare import write_json


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


class _Rollouts:
    def __init__(self, spec):
        self.manifest = {"prompts": {"spec": spec}} if spec else {}


@pytest.mark.parametrize(
    ("directory", "spec", "expected"),
    [
        ("runs/rollouts/gsm8k", "/data/gsm8k/test.jsonl:question", "gsm8k"),  # a real name
        ("demo/rollouts/eval/set", "stdlib:eval", "stdlib:eval"),
        ("demo/rollouts/eval/set", "/d/gsm8k/test.jsonl:question", "gsm8k/test.jsonl:question"),
        ("demo/rollouts/eval/set", "/d/mt_bench/question.jsonl", "mt_bench/question.jsonl"),
        ("demo/rollouts/eval/set", "hf:openai/gsm8k", "hf:openai/gsm8k"),
        ("demo/rollouts/eval/set", None, "set"),  # nothing better is known
    ],
)
def test_benchmark_names_say_what_the_prompts_were(tmp_path, directory, spec, expected):
    from blockdraft.evaluation.eval_compare import benchmark_name

    assert benchmark_name(_Rollouts(spec), tmp_path / directory) == expected
