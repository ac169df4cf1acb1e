"""The demo's prompt sets spread over many stdlib files (issue #28): a held-out set drawn
from a handful of files lets those files' repetitiveness decide every score, so the test
recounts, from the files themselves, how many could contribute and checks the selection
uses as many of them as its size allows."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.stdlib_prompts import file_prompts, stdlib_files, stdlib_split_of
from blockdraft.pipeline.demo import DemoSettings

S = DemoSettings()


def _files_with_prompts(split: str) -> int:
    return sum(
        bool(file_prompts(rel, split)) for rel in stdlib_files() if stdlib_split_of(rel) == split
    )


@pytest.mark.parametrize(
    ("spec", "count", "min_files"),
    [(S.eval_prompts, S.num_eval_prompts, 25), (S.train_prompts, S.num_train_prompts, 200)],
)
def test_demo_prompts_spread_over_files(spec, count, min_files):
    assert spec in ("stdlib:eval", "stdlib:train")  # the recount below reads stdlib files
    prompts = load_prompts(spec, limit=count)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    per_file = Counter(p.id.split(":")[0] for p in prompts)
    available = _files_with_prompts(spec.partition(":")[2])
    assert available >= min_files  # the split itself did not shrink
    # every file that has a prompt contributes before any contributes a second one
    assert len(per_file) == min(count, available)
    assert max(per_file.values()) <= math.ceil(count / available)
    assert max(per_file.values()) / count <= 0.05


def test_selection_is_a_prefix_and_deterministic():
    full = load_prompts("stdlib:eval")
    assert load_prompts("stdlib:eval", limit=40) == full[:40]
    # the whole split is there, each prompt once
    assert len(full) == sum(
        len(file_prompts(rel, "eval")) for rel in stdlib_files() if stdlib_split_of(rel) == "eval"
    )
