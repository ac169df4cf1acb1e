"""Code prompts cut from the Python standard library (`stdlib:*`): a source every machine has.

Each prompt is a function's signature plus its docstring, the classic "complete the
body" prompt. The split is by *file*, by the SHA-256 of its path relative to the stdlib
root (the first `EVAL_FRACTION` of the hash range is `eval`), so `stdlib:eval` shares no
file with training. A split's prompts come in rounds over its files (hashed order, each
file's functions hashed too), so the first N spread over as many files as N allows, not
a few files' repetitive functions. Prompts depend on the stdlib, which the manifest records.
"""

from __future__ import annotations

import ast
import functools
import textwrap

from blockdraft.data.prompt_type import Prompt, check_split, hash_fraction
from blockdraft.targets.tiny_corpus import stdlib_dir

EVAL_FRACTION = 0.1
# ~150 tokens of the tiny target's tokenizer: prompt + 128 new tokens then stays within
# ~2x of the 128-token windows `tiny` is trained on and within the 256-token windows its
# held-out loss is measured on (far beyond them its predictions degrade, which would make
# drafting look easier or harder for reasons unrelated to the drafter).
# Keeps 92% of the functions with a docstring.
MAX_PROMPT_CHARS = 600
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "turtledemo"}


def stdlib_split_of(relpath: str) -> str:
    """`"eval"` or `"train"` for a stdlib file path relative to the stdlib root."""
    return "eval" if hash_fraction(relpath) < EVAL_FRACTION else "train"


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[str, ...]:
    """All usable stdlib source files (relative posix paths, sorted); tests are excluded."""
    root = stdlib_dir()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in _SKIP_DIRS or p.startswith("test_") for p in parts):
            continue
        out.append(rel)
    return tuple(sorted(out))


def file_prompts(relpath: str, split: str) -> list[Prompt]:
    """Signature + docstring prompts of one stdlib file, in source order."""
    source = (stdlib_dir() / relpath).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a few stdlib files are templates or Python-2 era data
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node, qualname in _functions(tree, ""):
        body0 = node.body[0] if node.body else None
        if ast.get_docstring(node) is None or body0 is None:
            continue
        text = textwrap.dedent("".join(lines[node.lineno - 1 : body0.end_lineno]))
        if len(text) > MAX_PROMPT_CHARS or not text.strip():
            continue
        found.append(
            (
                node.lineno,
                Prompt(f"stdlib/{relpath}:{node.lineno}:{qualname}", text, None, f"stdlib:{split}"),
            )
        )
    return [p for _, p in sorted(found, key=lambda x: x[0])]


def _functions(node: ast.AST, prefix: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield child, qual
            yield from _functions(child, qual + ".")


@functools.lru_cache(maxsize=2)
def _split_prompts(split: str) -> tuple[Prompt, ...]:
    """Every prompt of a split, in rounds over its files (module docstring)."""
    files = sorted(
        (rel for rel in stdlib_files() if stdlib_split_of(rel) == split),
        key=lambda rel: hash_fraction(f"order/{rel}"),
    )
    per_file = [
        sorted(file_prompts(rel, split), key=lambda p: hash_fraction(f"order/{p.id}"))
        for rel in files
    ]
    rounds = max(map(len, per_file), default=0)
    return tuple(ps[r] for r in range(rounds) for ps in per_file if r < len(ps))


def stdlib_prompts(split: str, limit: int | None = None) -> list[Prompt]:
    """Prompts of the `train` or `eval` split, spread over its files, at most `limit`."""
    check_split("stdlib", split)
    return list(_split_prompts(split)[:limit])
