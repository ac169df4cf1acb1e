"""The drafter spec: text -> `DrafterSpec` -> text, one-line errors for bad text (library
and command line), and the text parsed where it enters only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from blockdraft.drafters.ngram import NgramConfig
from blockdraft.serialization.drafter_spec import (
    DrafterSpec,
    DrafterSpecError,
    checkpoint_of,
    display_name,
    load_drafter_spec,
)
from clikit import one_line_error, run_cli

SRC = Path(__file__).resolve().parents[2] / "src"
# where a spec's text enters: the command line, a suite file, the Python API
ENTRY_POINTS = {
    "blockdraft/serialization/drafter_spec.py",
    "blockdraft/cli/drafter_options.py",
    "blockdraft/evaluation/suite.py",
    "blockdraft/api.py",
}
STRING_METHODS = {"startswith", "partition", "split", "removeprefix", "match", "fullmatch"}
STRING_METHODS |= {"search", "compile"}


@pytest.mark.parametrize(
    "text, kind, path, options",
    [
        ("runs/dpace", "checkpoint", "runs/dpace", ()),
        ("runs/dpace/final", "checkpoint", "runs/dpace/final", ()),
        ("ngram", "ngram", None, ()),
        ("ngram:k=15,max=4,min=2", "ngram", None, (("k", "15"), ("max", "4"), ("min", "2"))),
        ("ngram:match=latest,k=3", "ngram", None, (("match", "latest"), ("k", "3"))),
        ("hybrid:runs/dpace", "hybrid", "runs/dpace", ()),
        ("hybrid:conf=0.5:runs/x", "hybrid", "runs/x", (("conf", "0.5"),)),
        ("hybrid:conf=0.25:runs/a:b", "hybrid", "runs/a:b", (("conf", "0.25"),)),
        ("trim:runs/dpace", "trim", "runs/dpace", ()),
        ("trim:conf=0.4:runs/x", "trim", "runs/x", (("conf", "0.4"),)),
    ],
)
def test_a_spec_round_trips(text, kind, path, options):
    spec = DrafterSpec.parse(text)
    assert (spec.kind, spec.path, spec.options) == (kind, path, options)
    assert str(spec) == text
    assert DrafterSpec.parse(str(spec)) == spec
    assert DrafterSpec.parse(spec) is spec  # already parsed: taken as it is


def test_a_spec_says_what_it_builds():
    assert DrafterSpec.parse("ngram:k=15,max=4,min=2").ngram().config == NgramConfig(15, 4, 2)
    assert DrafterSpec.parse("ngram:match=latest").ngram().config.match == "latest"
    assert DrafterSpec.parse("hybrid:runs/dpace").min_confidence == 0.3
    assert DrafterSpec.parse("hybrid:conf=0.5:runs/x").min_confidence == 0.5
    assert DrafterSpec.parse("ngram:") == DrafterSpec.parse("ngram")
    assert str(DrafterSpec.lookup(4)) == "ngram:k=4,max=3,min=1"  # the name the drafter has
    assert DrafterSpec.lookup(7) == DrafterSpec("ngram")  # the default K: plain `ngram`
    assert display_name(DrafterSpec.parse("ngram:k=4")) == "ngram:k=4"
    assert display_name(DrafterSpec.parse("hybrid:conf=0.5:runs/x/final")) == "x+ngram@0.5"
    assert display_name(DrafterSpec.parse("hybrid:runs/x")) == "x+ngram"
    assert DrafterSpec.parse("trim:runs/x").min_confidence == 0.3
    assert display_name(DrafterSpec.parse("trim:conf=0.4:runs/x/final")) == "x+trim@0.4"
    assert display_name(DrafterSpec.parse("trim:runs/x")) == "x+trim@0.3"
    assert display_name(DrafterSpec.parse("runs/x")) is None
    assert checkpoint_of(DrafterSpec.parse("ngram")) is None


BAD = [
    ("ngram:k=x", "expected ngram"),
    ("ngram:depth=3", "expected ngram"),
    ("ngram:k", "expected ngram"),
    ("ngram:min=3,max=2", "min <= max"),
    ("ngram:k=0", "k must be >= 1"),
    ("ngram:match=middle", "match must be latest or first"),
    ("hybrid:conf=0.5.1:runs/x", "conf must be in"),
    ("hybrid:conf=2:runs/x", "conf must be in"),
    ("hybrid:conf=0.5", "expected hybrid"),
    ("hybrid:", "expected hybrid"),
    ("trim:conf=-1:runs/x", "conf must be in"),
    ("trim:conf=0.5", "expected trim"),
    ("", "empty drafter spec"),
]


@pytest.mark.parametrize("text, why", BAD)
def test_a_bad_spec_is_one_line_quoting_it(text, why):
    with pytest.raises(DrafterSpecError, match=why) as info:
        DrafterSpec.parse(text)
    message = str(info.value)
    assert "\n" not in message
    assert repr(text) in message or not text


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--target", "tiny", "--rollouts", "r", "ngram:k=0"],
        ["compare", "--target", "tiny", "--rollouts", "r", "ngram", "hybrid:conf=2:runs/x"],
        ["suite", "--target", "tiny", "--benchmark", "b=stdlib:eval", "ngram:k=0"],
        ["suite", "--target", "tiny", "--benchmark", "b=stdlib:eval", "--baseline", "ngram:k"],
        ["decode", "--target", "tiny", "--prompts", "stdlib:eval", "--drafter", "ngram:k=0"],
    ],
)
def test_the_command_line_refuses_a_bad_spec_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as info:
        run_cli(capsys, *argv)
    assert info.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert "bad drafter spec" in line and "argument" in line


def test_below_the_entry_points_only_a_parsed_spec_is_taken():
    for call in (lambda: checkpoint_of("ngram"), lambda: load_drafter_spec("ngram", None)):
        with pytest.raises(TypeError, match="DrafterSpec.parse"):
            call()


def spec_parsers(src: Path) -> set[str]:
    """Files under `src` that parse drafter spec text: call `DrafterSpec.parse`, or take a
    string apart on the syntax's own words (`.startswith("hybrid:")`, `re.compile("^ngram")`)."""
    found = set()
    for f in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            on = node.func.value
            parses = (
                node.func.attr == "parse"
                and isinstance(on, ast.Name)
                and on.id
                in (
                    "DrafterSpec",
                    "cls",
                )
            )
            words = [
                a.value.lstrip("^")
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            splits = node.func.attr in STRING_METHODS and any(
                w.startswith(("ngram", "hybrid")) for w in words
            )
            if parses or splits:
                found.add(f.relative_to(src).as_posix())
    return found


def test_the_spec_text_is_parsed_where_it_enters_only():
    assert spec_parsers(SRC) <= ENTRY_POINTS, sorted(spec_parsers(SRC) - ENTRY_POINTS)
    assert "blockdraft/serialization/drafter_spec.py" in spec_parsers(SRC)  # the check sees


def test_a_planted_second_parser_is_found(tmp_path):
    planted = {
        "blockdraft/api.py": "DrafterSpec.parse(text)\n",  # an entry point: allowed
        "blockdraft/evaluation/x.py": "spec = DrafterSpec.parse(raw)\n",
        "blockdraft/decoding/y.py": "if s.startswith('hybrid:'):\n    pass\n",
        "blockdraft/drafters/z.py": "import re\nSPEC = re.compile(r'^ngram(?::(.*))?$')\n",
        "blockdraft/serving/w.py": "way = 'ngram'.upper()\n",  # not a parse
    }
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert spec_parsers(tmp_path) - ENTRY_POINTS == {
        "blockdraft/evaluation/x.py",
        "blockdraft/decoding/y.py",
        "blockdraft/drafters/z.py",
    }
