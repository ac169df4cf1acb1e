"""The house's structure, read from the source with `ast`: import cycles (function-level
imports included), imports that point up the layers, and imports of another module's
private (underscore) names.

The layers, bottom first (a package may import its own layer and those below):

    0  blockdraft/__init__, errors, devices, threads, heap, artifacts, user_cache, bootstrap
    1  objectives, sampling              (pure tensor maths; the sampling distribution)
    2  targets                           (the model being accelerated)
    3  drafters                          (what proposes tokens)
    4  serialization                     (checkpoints and export formats)
    5  data                              (prompts, rollouts, features)
    6  decoding                          (the online loop and its CPU speed code)
    7  evaluation                        (offline scoring, statistics, suites)
    8  training
    9  pipeline                          (demo, stages, reports)
    10 cli, __main__

`KNOWN` lists violations tolerated for now (none today): a new one fails, and so does a
listed one that is gone (delete it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [
    {"blockdraft", "errors", "devices", "threads", "heap", "artifacts", "user_cache", "bootstrap"},
    {"objectives", "sampling"},
    {"targets"},
    {"drafters"},
    {"serialization"},
    {"data"},
    {"decoding"},
    {"evaluation"},
    {"training"},
    {"pipeline"},
    {"cli", "__main__"},
]
KNOWN: set[tuple[str, str]] = set()


def modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package `__init__`), for every file under `src`."""
    out = {}
    for f in sorted(src.rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def imports(src: Path, root: str) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, imported name or None) for every import statement, at
    module level or inside functions, of a module under `root` into `root`."""
    mods = modules(src)
    found = []
    for mod, (file, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                pairs = [(base, a.name) for a in node.names]
            else:
                continue
            for base, name in pairs:
                if base != root and not base.startswith(root + "."):
                    continue
                if name is not None and f"{base}.{name}" in mods:
                    found.append((mod, f"{base}.{name}", None))  # a submodule
                elif base in mods:
                    found.append((mod, base, name))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else parts[0]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: package {top!r} is in no layer (add it to LAYERS)")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def violations(src: Path, root: str = "blockdraft") -> set[tuple[str, str]]:
    found = imports(src, root)
    edges: dict[str, set[str]] = {}
    out = set()
    for a, b, name in found:
        if a == b:
            continue
        edges.setdefault(a, set()).add(b)
        if _layer(b) > _layer(a):
            out.add(("upward", f"{a} -> {b}"))
        if name is not None and name.startswith("_") and not name.startswith("__"):
            out.add(("private", f"{a} -> {b}.{name}"))
    for comp in _cycles(edges):
        out.add(("cycle", " -> ".join(comp)))
    return out


def test_the_house_has_no_new_structural_violations():
    found = violations(SRC)
    new, fixed = found - KNOWN, KNOWN - found
    assert not new, "new structural violations:\n" + "\n".join(map(str, sorted(new)))
    assert not fixed, "fixed (delete from KNOWN):\n" + "\n".join(map(str, sorted(fixed)))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "blockdraft" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [p for p in (tmp_path / "blockdraft").rglob("*") if p.is_dir()]:
        (d / "__init__.py").touch()
    (tmp_path / "blockdraft" / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # a cycle hidden behind a function-level import
            {"data/a.py": "from blockdraft.data import b\n",
             "data/b.py": "def f():\n    from blockdraft.data.a import x\n"},
            {("cycle", "blockdraft.data.a -> blockdraft.data.b")},
        ),
        (  # drafters reaching up into training, relative import inside a function
            {"drafters/m.py": "def f():\n    from ..training import t\n", "training/t.py": ""},
            {("upward", "blockdraft.drafters.m -> blockdraft.training.t")},
        ),
        (  # decoding reaching up into evaluation: the edge the layers order forbids
            {"decoding/r.py": "from blockdraft.evaluation.s import ci\n",
             "evaluation/s.py": "ci = 1\n"},
            {("upward", "blockdraft.decoding.r -> blockdraft.evaluation.s")},
        ),
        (  # another module's private name
            {"data/a.py": "from blockdraft.data.b import _helper, public\n",
             "data/b.py": "def _helper(): ...\npublic = 1\n"},
            {("private", "blockdraft.data.a -> blockdraft.data.b._helper")},
        ),
        (  # downward imports, dunder names and a package's own module are fine
            {"training/t.py": "from blockdraft.drafters import m\n"
                              "from blockdraft import __version__\n",
             "drafters/m.py": "from blockdraft.errors import E\n", "errors.py": "E = 1\n"},
            set(),
        ),
    ],
)  # fmt: skip
def test_planted_violations_are_found(tmp_path, files, expected):
    assert violations(_tree(tmp_path, files)) == expected


def test_a_package_outside_the_layers_is_named(tmp_path):
    src = _tree(tmp_path, {"gadgets/g.py": "from blockdraft.errors import E\n", "errors.py": ""})
    with pytest.raises(AssertionError, match="'gadgets' is in no layer"):
        violations(src)
