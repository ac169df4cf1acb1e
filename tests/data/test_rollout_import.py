"""`blockdraft rollout-import`: engine outputs -> the rollout set `blockdraft rollout` writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blockdraft.data.prompt_type import Prompt
from blockdraft.data.rollouts import RolloutSet, SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.importer import (
    DUPLICATE,
    ENGINE_ERROR,
    FILTERED,
    NO_ROUND_TRIP,
    OTHER_SETTINGS,
    OUT_OF_VOCAB,
    PAST_STOP,
    TOO_LONG,
    import_rollouts,
)
from blockdraft.data.rollouts.sampler import generate_batch
from blockdraft.data.rollouts.store import RolloutError
from random_targets import make_random_target

TEXTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os", "The quick", "x"]
S = SamplingSettings(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=10, seed=4)


def _prompts() -> list[Prompt]:
    return [Prompt(f"q{i}", t, None, "test") for i, t in enumerate(TEXTS)]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _settings_dict(s: SamplingSettings) -> dict:
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": 10}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3-softcap"])
def test_import_gives_the_logprobs_blockdraft_rollout_stores(random_target, tmp_path, arch):
    target = random_target
    if arch == "gemma3-softcap":  # exercises the final logit soft-capping path
        target = make_random_target("gemma3")
        target.model.config.final_logit_softcapping = 3.0
    ref = generate_rollouts(
        target, _prompts(), tmp_path / "ref", S, batch_size=4, store_topk=3, progress=False
    )
    stop = set(target.stop_token_ids)
    records = []
    for i, r in enumerate(ref):
        ids = r.response_ids.tolist()
        ended = ids[-1] in stop
        body = ids[:-1] if ended else ids
        if i % 3 == 0:  # flat form with token ids
            records.append(
                {
                    "id": r.prompt_id,
                    "prompt_token_ids": r.prompt_ids.tolist(),
                    "response_token_ids": ids,
                    "settings": _settings_dict(S),
                }
            )
        elif i % 3 == 1:  # vLLM offline RequestOutput: token ids include the EOS
            records.append(
                {
                    "prompt_id": r.prompt_id,
                    "prompt": TEXTS[i],
                    "outputs": [{"token_ids": ids, "finish_reason": "stop" if ended else "length"}],
                    "sampling_params": dict(_settings_dict(S), top_k=S.top_k or -1),
                }
            )
        else:  # OpenAI chat completion from vLLM with return_token_ids (EOS included)
            records.append(
                {
                    "custom_id": r.prompt_id,
                    "response": {
                        "status_code": 200,
                        "body": {
                            "choices": [
                                {
                                    "message": {
                                        "role": "assistant",
                                        "content": target.decode(body),
                                    },
                                    "finish_reason": "stop" if ended else "length",
                                    "stop_reason": None,
                                    "token_ids": ids,
                                }
                            ]
                        },
                    },
                    "request": {
                        "body": dict(
                            _settings_dict(S), messages=[{"role": "user", "content": TEXTS[i]}]
                        )
                    },
                }
            )
    src = _write(tmp_path / "engine.jsonl", records)
    report = import_rollouts(
        target, src, tmp_path / "imp", store_topk=3, shard_size=4, progress=False
    )
    assert report.dropped == {} and report.imported == len(TEXTS)
    imp = RolloutSet.open(tmp_path / "imp")
    # stated in the file: max_tokens -> max_new_tokens, top_k -1 -> 0
    assert imp.settings == replace(S, seed=0)
    assert imp.complete and [r.prompt_id for r in imp] == [r.prompt_id for r in ref]
    for a, b in zip(imp, ref, strict=True):
        assert torch.equal(a.prompt_ids, b.prompt_ids)
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.allclose(a.logprobs, b.logprobs, atol=2e-5), a.prompt_id
        assert torch.allclose(a.topk_logprobs, b.topk_logprobs, atol=2e-5)
        assert torch.equal(a.topk_ids[:, 0], b.topk_ids[:, 0])
    m = imp.manifest
    assert m["import"]["imported"] == len(TEXTS) and m["import"]["dropped"] == {}
    assert m["target"] == ref.manifest["target"] and m["store_topk"] == 3
    # the same import again is a no-op resume; another file into the same set is refused
    again = import_rollouts(
        target, src, tmp_path / "imp", store_topk=3, shard_size=4, progress=False
    )
    assert again.imported == len(TEXTS)
    other = _write(tmp_path / "other.jsonl", records[:2])
    with pytest.raises(RolloutError, match="import.sha256 differs"):
        import_rollouts(target, other, tmp_path / "imp", store_topk=3, shard_size=4, progress=False)


def test_drops_are_counted_with_reasons_and_lines(random_target, tmp_path):
    t = random_target
    g = torch.Generator().manual_seed(0)
    p = t.encode("def f(x):")
    ok = [int(i) for i in torch.randint(3, 300, (6,), generator=g)]
    eos = t.stop_token_ids[0]
    base = {"prompt_token_ids": p}
    recs = [
        dict(base, id="a", token_ids=ok),  # line 1, kept
        dict(base, id="b", token_ids=[ok[0], eos, ok[1]]),  # stop token mid-response
        dict(base, id="c", token_ids=ok + [10_000]),  # outside the vocabulary
        dict(base, id="d", token_ids=ok * 3),  # longer than max_new_tokens
        dict(base, id="a", token_ids=ok),  # duplicate id
        dict(base, id="e", text="a\ud800b"),  # lone surrogate: cannot be tokenized
        dict(base, id="f", error={"message": "overloaded"}, choices=[]),  # engine error
        dict(base, id="h", token_ids=ok, settings={"temperature": 0.5}),  # other settings
        dict(base, id="i", text="hello world", finish_reason="stop"),  # kept, EOS appended
        dict(base, id="j", token_ids=ok, settings={"temperature": 1.0, "max_tokens": 7}),  # kept
    ]
    src = _write(tmp_path / "e.jsonl", recs)
    rep = import_rollouts(
        t, src, tmp_path / "o", {"temperature": 1.0, "max_new_tokens": 12}, progress=False
    )
    assert rep.dropped == {
        PAST_STOP: [2],
        OUT_OF_VOCAB: [3],
        TOO_LONG: [4],
        DUPLICATE: [5],
        NO_ROUND_TRIP: [6],
        ENGINE_ERROR: [7],
        OTHER_SETTINGS: [8],
    }
    assert [r.prompt_id for r in rep.rollouts] == ["a", "i", "j"]  # file order
    i_row = rep.rollouts[1]
    assert i_row.response_ids[-1] == eos and t.decode(i_row.response_ids[:-1]) == "hello world"
    text = rep.summary()
    assert "imported 3 of 10 responses" in text and "dropped 7:" in text
    assert "1 text does not round-trip through the tokenizer (line 6)" in text
    m = RolloutSet.open(tmp_path / "o").manifest
    assert m["import"]["dropped"][NO_ROUND_TRIP] == 1 and m["import"]["imported"] == 3

    # a token the stated top-k removes: the engine sampled with other settings
    greedy = generate_batch(t, [p], ["g"], SamplingSettings(0.0, max_new_tokens=6))[0]
    worst = int(t.forward(torch.tensor([p])).logits[0, -1].argmin())
    src = _write(
        tmp_path / "k.jsonl",
        [dict(base, id="g", token_ids=greedy.response_ids), dict(base, id="w", token_ids=[worst])],
    )
    rep = import_rollouts(t, src, tmp_path / "k", {"temperature": 1.0, "top_k": 5}, progress=False)
    assert rep.dropped == {FILTERED: [2]} and [r.prompt_id for r in rep.rollouts] == ["g"]


def test_bad_files_are_one_line_errors_and_write_nothing(random_target, tmp_path):
    good = {"id": "x", "prompt": "def", "text": "abc"}
    cases = [
        ([good, "{oops"], r"bad.jsonl:2: invalid JSON"),
        ([good, {"id": "y", "prompt": "a"}], r"bad.jsonl:2: no response found .*token_ids"),
        ([good, {"id": "y", "prompt": "a", "response": 5}], r"bad.jsonl:2: 'response' is int 5"),
        (
            [good, {"id": "y", "prompt": "a", "choices": [{"message": {"content": [1]}}]}],
            r"bad.jsonl:2: message.'content' is list",
        ),
        (
            [good, {"id": "y", "prompt": "a", "token_ids": ["a"]}],
            r"bad.jsonl:2: key 'token_ids' must",
        ),
        ([{"id": "y", "text": "a"}], r"bad.jsonl:1: no prompt .*--prompts"),
        ([good, [1, 2]], r"bad.jsonl:2: expected a JSON object"),
    ]
    for lines, pattern in cases:
        src = tmp_path / "bad.jsonl"
        src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
        with pytest.raises(RolloutError, match=pattern):
            import_rollouts(
                random_target, src, tmp_path / "out", {"temperature": 1.0}, progress=False
            )
    src.write_text(json.dumps(good) + "\n")
    with pytest.raises(RolloutError, match="sampling settings not stated: pass --temperature"):
        import_rollouts(random_target, src, tmp_path / "out", progress=False)
    with pytest.raises(RolloutError, match="bad sampling settings .*top_p"):
        import_rollouts(
            random_target, src, tmp_path / "out", {"temperature": 1, "top_p": 2}, progress=False
        )
    assert not (tmp_path / "out").exists()
    with pytest.raises(RolloutError, match="missing.jsonl: no such file"):
        import_rollouts(random_target, tmp_path / "missing.jsonl", tmp_path / "out", progress=False)


def test_cli_rollout_import_joins_prompts_by_id(random_target, tmp_path, monkeypatch, capsys):
    import blockdraft.cli.rollout as rollout_cli
    from blockdraft.cli import main

    monkeypatch.setattr(rollout_cli, "load_target", lambda name, **kw: random_target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    src = _write(
        tmp_path / "batch.jsonl",
        [  # OpenAI batch output: no prompt, joined on custom_id
            {
                "custom_id": f"q{i}",
                "response": {
                    "status_code": 200,
                    "body": {
                        "choices": [
                            {"message": {"content": " return 1"}, "finish_reason": "length"}
                        ]
                    },
                },
                "error": None,
            }
            for i in range(len(TEXTS))
        ]
        + [{"custom_id": "zz", "response": {"body": {"choices": [{"text": "x"}]}}}],
    )
    args = [
        "rollout-import",
        str(src),
        "--target",
        "t",
        "--out",
        str(tmp_path / "o"),
        "--prompts",
        str(prompts),
        "--temperature",
        "0.7",
        "--top-k",
        "-1",
        "--no-progress",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"imported {len(TEXTS)} of {len(TEXTS) + 1} responses" in out
    assert "1 id not found in --prompts (line 7)" in out
    rs = RolloutSet.open(tmp_path / "o")
    assert rs.settings.top_k == 0 and rs.settings.temperature == 0.7
    assert rs.settings.max_new_tokens == max(r.response_len for r in rs)
    assert rs[0].prompt_ids.tolist() == random_target.encode(TEXTS[0])
    assert main([*args[:-5], "--temperature", "0.5", "--no-progress"]) == 2
    assert "settings.temperature differs" in capsys.readouterr().err


def test_text_responses_are_retokenised_and_scored(random_target, tmp_path):
    """Text-only engine output (EOS left out): re-encoded, EOS appended, scored like a rollout."""
    t = random_target
    s = SamplingSettings(temperature=1.0, max_new_tokens=32)
    answers = [" return a + b", "\n    def __init__(self):", " os.path", "print(i)"]
    recs = [
        {"id": f"q{i}", "prompt": TEXTS[i], "choices": [{"text": a, "finish_reason": "stop"}]}
        for i, a in enumerate(answers)
    ]
    src = _write(tmp_path / "text.jsonl", recs)
    rep = import_rollouts(t, src, tmp_path / "o", {"temperature": 1.0}, progress=False)
    assert rep.dropped == {} and rep.rollouts.settings.max_new_tokens == max(
        len(t.encode(a)) + 1 for a in answers
    )
    for r, a, text in zip(rep.rollouts, answers, TEXTS[:4], strict=True):
        assert r.prompt_ids.tolist() == t.encode(text)
        assert r.response_ids.tolist() == t.encode(a) + [t.stop_token_ids[0]]
        logits = t.forward(r.input_ids[None]).logits[0, r.prompt_len - 1 : -1]
        ref = torch.log_softmax(logits.double(), -1).gather(-1, r.response_ids[:, None])[:, 0]
        assert torch.allclose(r.logprobs.double(), ref, atol=2e-5)
    assert s.temperature == rep.rollouts.settings.temperature
