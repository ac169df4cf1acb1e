"""The product documentation speaks to users: no development history, no dead links.

README.md, docs/ and src/ must not cite work sessions, commit hashes or issue numbers
(research/ is the lab notebook and may), every `docs/methods.md` section that a source file
cites must exist, and every relative link in README.md, docs/*.md and research/*.md must
reach an existing file (and, for a markdown file, an existing heading when the link names one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (name, pattern): what counts as development history in the product
HISTORY = [
    ("work session", re.compile(r"\bsessions? \d+", re.I)),
    ("issue number", re.compile(r"\bissues? #?\d+", re.I)),
    ("issue reference", re.compile(r"(?<![\w&/])#\d{2,}\b")),
    # a hex word of 7-40 characters in backticks with a digit and a letter: a commit hash
    ("commit hash", re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}`")),
    ("the brief's METHODS.md", re.compile(r"METHODS\.md")),
]


def product_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files += sorted((REPO / "src").rglob("*.py"))
    return files


def history_mentions(text: str) -> list[str]:
    """`name: line` for each line of `text` that cites development history."""
    found = []
    for line in text.splitlines():
        for name, pattern in HISTORY:
            if pattern.search(line):
                found.append(f"{name}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize(
    "line",
    [
        "measured in session 23 on a fresh clone",
        "a fresh clone of `804b9f1`",
        "the fix of issue #31",
        "as issue 30 asked",
        "see #28 for the numbers",
        '"""The offline evaluator (METHODS.md §3)."""',
    ],
)
def test_history_patterns_catch_history(line: str) -> None:
    assert history_mentions(line)


@pytest.mark.parametrize(
    "line",
    [
        "[section](#6-edr-as-in-the-paper)",
        "the `1000000`-token budget and `deadbeef` ids",
        "the session's progress bar",
        "`rounds: 15`",
    ],
)
def test_history_patterns_spare_ordinary_text(line: str) -> None:
    assert not history_mentions(line)


def test_no_development_history_in_the_product() -> None:
    found = []
    for path in product_files():
        for hit in history_mentions(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(REPO)}: {hit}")
    assert not found, "development history in the product:\n" + "\n".join(found)


def heading_names(markdown: str) -> set[str]:
    """Section names of a page: each heading's text, and that text without a trailing
    parenthetical such as "(`blockdraft/objectives/dpace.py`)"."""
    names = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} +(.+?)\s*$", line)):
            text = m.group(1)
            names.add(text)
            names.add(re.sub(r"\s*\([^()]*\)$", "", text))
    return names


METHODS_CITATION = re.compile(r'docs/methods\.md[,;]?\s*\(?"([^"]+)"')


def test_source_cites_existing_methods_sections() -> None:
    names = heading_names((REPO / "docs" / "methods.md").read_text(encoding="utf-8"))
    missing = []
    for path in sorted((REPO / "src").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for cited in METHODS_CITATION.findall(re.sub(r"\s*\n\s*#?\s*", " ", text)):
            if cited not in names:
                missing.append(f"{path.relative_to(REPO)}: {cited!r}")
    assert not missing, "docs/methods.md has no such section:\n" + "\n".join(missing)


def test_methods_citation_pattern_reads_both_forms() -> None:
    text = 'see docs/methods.md, "EDR" and docs/methods.md ("The offline evaluator")'
    assert METHODS_CITATION.findall(text) == ["EDR", "The offline evaluator"]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    names = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} +(.+?)\s*$", line)):
            names.add(anchor(m.group(1)))
    return names


LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors_of(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## The demo\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#the-demo) [gone](c.md) [bad](a.md#nothing) [web](https://x.y)\n")
    assert broken_links(page) == ["c.md (no such file)", "a.md#nothing (no such heading)"]


@pytest.mark.parametrize(
    "page",
    [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "research").glob("*.md")),
    ],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(REPO)}: " + ", ".join(broken_links(page))


DOCS_LINE_BUDGET = 3000


def docs_lines(docs: Path) -> int:
    """Lines of the product documentation: every .md under `docs`, research/ left out (the
    lab notebook lives at the top level, but a docs/research/ would not count either)."""
    pages = [p for p in docs.rglob("*.md") if "research" not in p.relative_to(docs).parts]
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in pages)


def test_docs_line_counter_counts_pages_and_skips_research(tmp_path: Path) -> None:
    (tmp_path / "research").mkdir()
    (tmp_path / "a.md").write_text("1\n2\n3\n")
    (tmp_path / "research" / "log.md").write_text("x\n" * 50)
    assert docs_lines(tmp_path) == 3


def test_docs_stay_within_their_line_budget() -> None:
    """docs/ is read by users: measurement logs belong in research/ (linked from docs)."""
    lines = docs_lines(REPO / "docs")
    assert lines <= DOCS_LINE_BUDGET, (
        f"docs/ has {lines} lines, over the budget of {DOCS_LINE_BUDGET}: move measurement "
        "logs to research/ and cut repetition"
    )
