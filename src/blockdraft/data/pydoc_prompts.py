"""Prose and instruction prompts cut from the documentation Python ships (`pydoc:*`).

Why: a drafter served for chat must see the target answer instructions, and no chat data
set ships offline, but Python carries prose: its language reference (`pydoc_data.topics`)
and its stdlib module docstrings. Each paragraph becomes an instruction ("Summarize ...",
"Explain ...") in one of a few phrasings picked by a hash of the prompt id. The split is
by topic or file hash (a stdlib file's docstring follows `stdlib:*`'s split), so
`pydoc:eval` shares no source with `pydoc:train`; chat benchmarks stay held out.
"""

from __future__ import annotations

import ast
import functools
import re
from pydoc_data.topics import topics

from blockdraft.data.prompt_type import Prompt, check_split, hash_fraction
from blockdraft.data.stdlib_prompts import stdlib_files, stdlib_split_of
from blockdraft.targets.tiny_corpus import stdlib_dir

EVAL_FRACTION = 0.1
MIN_PARAGRAPH_CHARS = 160
MAX_PARAGRAPH_CHARS = 700
TEMPLATES = (
    "Summarize the following passage in a few sentences.\n\n{text}\n",
    "Explain the following to a beginner, in plain words and with an example.\n\n{text}\n",
    "Rewrite this paragraph so that it is clearer and shorter.\n\n{text}\n",
    "{text}\n\nQuestion: what is the main point of the passage above?\nAnswer:",
    "Write a short tutorial about {title} in Python, with one example.",
    "Answer the question. What is {title} in Python and when would you use it?",
)


def pydoc_split_of(topic: str) -> str:
    """`"eval"` or `"train"` for a documentation topic (a hash of its name)."""
    return "eval" if hash_fraction(f"pydoc/{topic}") < EVAL_FRACTION else "train"


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a topic: no grammar rules, code or tables (indented blocks), no
    headings; joined lines, of a length that leaves room for an answer."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(ln.startswith((" ", "\t")) for ln in lines):
            continue
        if re.fullmatch(r"[*=\-~^]+", lines[-1].strip()):  # a heading's underline
            continue
        para = " ".join(ln.strip() for ln in lines)
        if MIN_PARAGRAPH_CHARS <= len(para) <= MAX_PARAGRAPH_CHARS:
            out.append(para)
    return out


def _title(text: str, topic: str) -> str:
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first if 0 < len(first) <= 60 else f'"{topic}"'


def _instructions(key: str, title: str, text: str, split: str) -> list[Prompt]:
    out = []
    for i, para in enumerate(_paragraphs(text)):
        pid = f"pydoc/{key}/{i}"
        template = TEMPLATES[int(hash_fraction(pid) * len(TEMPLATES))]
        out.append(Prompt(pid, template.format(text=para, title=title), None, f"pydoc:{split}"))
    return out


def _module_docstring(relpath: str) -> str | None:
    source = (stdlib_dir() / relpath).read_text(encoding="utf-8", errors="replace")
    try:
        return ast.get_docstring(ast.parse(source))
    except SyntaxError:
        return None


@functools.lru_cache(maxsize=2)
def pydoc_prompts_of_split(split: str) -> tuple[Prompt, ...]:
    """The language reference's topics (sorted), then stdlib module docstrings (by path)."""
    out = []
    for topic in sorted(topics):
        if pydoc_split_of(topic) == split:
            out += _instructions(topic, _title(topics[topic], topic), topics[topic], split)
    for rel in stdlib_files():
        if stdlib_split_of(rel) != split:
            continue
        doc = _module_docstring(rel)
        if doc:
            name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            out += _instructions(f"module/{rel}", f"the {name} module", doc, split)
    return tuple(out)


def pydoc_prompts(split: str, limit: int | None = None) -> list[Prompt]:
    """Prompts of the `train` or `eval` split (topics in sorted order), at most `limit`."""
    check_split("pydoc", split)
    prompts = list(pydoc_prompts_of_split(split))
    return prompts[:limit] if limit is not None else prompts
