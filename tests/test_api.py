"""The Python API (`blockdraft.api`, docs/python-api.md): cheap to import, every name there,
every docstring example runs (in the module's order, one shared namespace: they form the
pipeline on the `tiny` target), and each result has the keys of its command's `--json`.

One key vocabulary: the same quantity has the same key in every output (`mal` the offline
MAL, `tau` the online one, `mal_gain`/`rel_gain` a paired gain), so the demo's report.json
may only use keys that `eval`, `compare` or `decode` write.
"""

from __future__ import annotations

import doctest
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import blockdraft
from blockdraft import api
from blockdraft.cli import main
from blockdraft.pipeline.demo import DemoSettings, build_report_json
from blockdraft.user_cache import CACHE_ENV

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "vllm", "matplotlib", "numba")


def test_import_blockdraft_loads_no_heavy_package():
    code = f"import sys, blockdraft; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # ... and the first API name does load the library (the check above can fail)
    code = code.replace("blockdraft;", "blockdraft; blockdraft.evaluate;")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout


def test_every_api_name_is_on_the_package():
    assert sorted(blockdraft.API) == sorted(api.__all__)
    for name in api.__all__:
        assert getattr(blockdraft, name) is getattr(api, name)
        assert name in dir(blockdraft)
    with pytest.raises(AttributeError, match="no attribute 'evaluat'"):
        blockdraft.evaluat  # noqa: B018


def docstring_examples() -> list[tuple[str, str]]:
    """(function, source) of every `>>>` example in `blockdraft.api`, in file order."""
    parser = doctest.DocTestParser()
    found = []
    for name, fn in inspect.getmembers(api, inspect.isfunction):
        if fn.__module__ == api.__name__ and fn.__doc__:
            line = inspect.getsourcelines(fn)[1]
            for i, ex in enumerate(parser.get_examples(fn.__doc__)):
                found.append((line, i, name, ex.source))
    return [(name, src) for _, _, name, src in sorted(found)]


def test_every_public_function_has_an_example():
    with_example = {name for name, _ in docstring_examples()}
    functions = {n for n in api.__all__ if inspect.isfunction(getattr(api, n))}
    assert functions - {"load_prompts"} <= with_example


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The docstring examples run one after another in a scratch directory holding the
    repo's `configs/` and `examples/`; (that directory, the namespace they filled)."""
    work = tmp_path_factory.mktemp("api")
    for name in ("configs", "examples"):
        (work / name).symlink_to(REPO / name)
    namespace: dict[str, Any] = {"blockdraft": blockdraft}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv(CACHE_ENV, str(work / "cache"))
        for name, source in docstring_examples():
            try:
                exec(compile(source, f"<{name} example>", "exec"), namespace)  # noqa: S102
            except Exception as exc:
                raise AssertionError(f"{name}'s example failed: {source}") from exc
        yield work, namespace


def test_docstring_examples_run(pipeline):
    work, ns = pipeline
    assert (work / "runs" / "quick" / "final").is_dir() and (work / "export" / "quick").is_dir()
    assert [d["name"] for d in ns["scores"]["benchmarks"][0]["drafters"]] == ["ngram", "quick"]


def key_paths(obj: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON document (`benchmarks[].drafters[].mal`), list items merged."""
    if isinstance(obj, dict):
        out = set()
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else k
            out |= {path} | key_paths(v, path)
        return out
    if isinstance(obj, list):
        return set().union(*(key_paths(v, prefix + "[]") for v in obj))
    return set()


def test_key_paths_sees_nested_keys():
    doc = {"a": [{"b": 1}, {"c": {"d": 2}}], "e": 3}
    assert key_paths(doc) == {"a", "a[].b", "a[].c", "a[].c.d", "e"}


def _cli_json(work: Path, argv: list[str]) -> dict[str, Any]:
    out = work / "cli.json"
    cwd = os.getcwd()
    try:
        os.chdir(work)
        assert main([*argv, "--target", "tiny", "--device", "cpu", "--no-progress",
                     "--json", str(out), "--overwrite"]) == 0  # fmt: skip
    finally:
        os.chdir(cwd)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "result, argv",
    [
        ("scores", ["eval", "--rollouts", "rollouts/heldout", "ngram", "runs/quick"]),
        ("gains", ["compare", "--rollouts", "rollouts/heldout", "ngram", "runs/quick"]),
        ("table", ["suite", "--benchmark", "heldout=examples/heldout.jsonl", "--limit", "4",
                   "--rollouts-dir", "rollouts/suite", "runs/quick"]),
        ("decoded", ["decode", "--drafter", "runs/quick", "--prompts",
                     "examples/heldout.jsonl", "--limit", "1", "--max-new-tokens", "8"]),
    ],
)  # fmt: skip
def test_python_results_have_the_keys_of_the_commands_json(pipeline, result, argv):
    work, ns = pipeline
    mine, theirs = (
        key_paths(json.loads(json.dumps(ns[result], default=str))),
        key_paths(_cli_json(work, argv)),
    )
    assert mine == theirs, f"only in Python: {mine - theirs}; only in JSON: {theirs - mine}"


def test_report_json_speaks_the_commands_vocabulary(pipeline):
    """Each key of report.json's drafter and comparison rows is a key `eval` or `decode`
    (drafters) or `compare` (comparisons) writes for the same quantity."""
    work, ns = pipeline
    eval_row = ns["scores"]["benchmarks"][0]["drafters"][0]
    report = build_report_json(
        DemoSettings(),
        {"eval": work / "rollouts" / "heldout"},
        ns["scores"],
        ns["gains"]["comparisons"],
        {"quick": {**ns["decoded"], "offline_mal": 1.0, "offline_mal_ci95": [1.0, 1.0]}},
    )
    own = {"objective", "speedup_vs_hf"}  # the demo's alone (decode --vs-hf writes the latter)
    drafter_keys = set(eval_row) | set(ns["decoded"]) | {"offline_mal"} | own
    assert set(report["drafters"][0]) - drafter_keys == set()
    assert set(report["comparisons"][0]) <= set(ns["gains"]["comparisons"][0])
    for row in (*report["drafters"], *report["comparisons"]):
        assert not {"mal_offline", "tau_online", "diff"} & set(row)


@pytest.fixture(scope="module")
def tiny_target():
    return api.load_target("tiny", device="cpu", progress=False)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (
            lambda t, d: api.evaluate("tiny", "ngram", d),
            r"evaluate: target must be a Target.*"
            r"blockdraft.load_target\('tiny'\)",
        ),
        (lambda t, d: api.compare(None, ["ngram", "ngram:k=3"], d), "compare: target must be"),
        (lambda t, d: api.evaluate(t, "ngram", 5), r"rollouts: expected a path"),
        (lambda t, d: api.evaluate(t, ["ngram", 3], d), r"drafters\[1\]: expected a path"),
        (lambda t, d: api.evaluate(t, "ngram", d, n_boot="100"), "n_boot must be an integer"),
        (lambda t, d: api.evaluate(t, "ngram", d, seed=1.5), "seed must be an integer"),
        (lambda t, d: api.decode(t, "ngram", ["x"], temperature="0"), "temperature must be"),
        (lambda t, d: api.decode(t, "ngram", ["x"], top_p=0), "top_p must be a number in"),
        (lambda t, d: api.decode(t, "ngram", [["x"]]), r"prompts\[0\]: expected a non-empty"),
        (lambda t, d: api.generate_rollouts(t, [1, 2], d / "new"), r"prompts\[0\].* got 1"),
        (lambda t, d: api.generate_rollouts(t, ["ok", ""], d / "new"), r"prompts\[1\]"),
        (lambda t, d: api.generate_rollouts(t, ["a"], d / "new", max_new_tokens=0), "max_new"),
        (lambda t, d: api.load_drafter("ngram", "tiny"), "load_drafter: target must be"),
        (lambda t, d: api.decode(t, "ngram", ["x"], drafter_dtype="int8"), "--drafter-dtype"),
        (lambda t, d: api.load_target("tiny", device="mps"), "--device 'mps'"),
        (lambda t, d: api.export("ngram", d / "new", dtype="int8"), "export: dtype must be"),
        (lambda t, d: api.export("ngram", d / "new", dtype="nope"), "export: dtype must be"),
        (lambda t, d: api.train("tiny", 5), "train: overrides must be"),
        (lambda t, d: api.train(3), "train: config must be"),
        # a shipped recipe by name, as `train --config tiny` takes it: it is found, and
        # the next error is the missing rollouts, named by their key
        (
            lambda t, d: api.train(
                "tiny", {"data.train_rollouts": str(d / "none"), "run_dir": str(d / "new")}
            ),
            "data.train_rollouts",
        ),
    ],
)
def test_wrong_arguments_are_one_line_value_errors(tiny_target, tmp_path, call, says):
    """docs/python-api.md: bad input raises a ValueError whose first line names the
    argument, never an AttributeError or TypeError from deep inside, and writes nothing."""
    with pytest.raises(ValueError, match=says) as info:
        call(tiny_target, tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "new").exists()
