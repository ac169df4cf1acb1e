"""The house's structure, read from the source with `ast`: import cycles (function-level
imports included), imports that point up the layers, imports of another module's
private (underscore) names, and function-level imports (only of a heavy or optional
third-party package, or of a module in `LAZY_MODULES`, and each marked `# lazy: <why>`
on its line or in the comment lines right above it; consecutive imports share one mark).

The layers, bottom first (a package may import its own layer and those below):

    0  blockdraft/__init__, errors, devices, threads, heap, artifacts, user_cache, bootstrap_ci,
       recipes (the shipped config recipes)
    1  objectives, sampling, kernels     (pure tensor maths; the sampling distribution; exact
                                         CPU kernels)
    2  targets                           (the model being accelerated)
    3  drafters                          (what proposes tokens)
    4  serialization                     (checkpoints and export formats)
    5  engines                           (serving engines behind the `Engine` interface)
    6  data                              (prompts, rollouts, features)
    7  decoding                          (the online loop and its CPU speed code)
    8  evaluation                        (offline scoring, statistics, suites)
    9  serving                           (exported drafters checked in an engine)
    10 training
    11 pipeline                          (demo, stages, reports)
    12 api                               (the Python API: one function per command)
    13 cli, __main__

`test_docstring_lists_every_layer` keeps this list equal to `LAYERS`.

`blockdraft/__init__` reaches the API only by name, on first use (its `__getattr__`), so
`import blockdraft` loads nothing below it.

Beyond the order, `FORBIDDEN` names packages that must not import another even where
the layers allow it: training uses what decoding uses only through the shared layer below
both (`kernels/`), never the decoder's own modules. `SEALED` packages are reached from
the named importers through their `__init__` only: training asks `objectives.edr` for
what its step needs through the package's exports, not its internals. And the training
steps (`training/steps/`) take at most `MAX_STEP_PARAMETERS` parameters a function: what
a step needs travels as one typed object, not a dozen keywords.

`KNOWN` lists violations tolerated for now (none today): a new one fails, and so does a
listed one that is gone (delete it from the list).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from blockdraft.cli import STAGES

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [
    {
        "blockdraft",
        "errors",
        "devices",
        "threads",
        "heap",
        "artifacts",
        "user_cache",
        "bootstrap_ci",
        "recipes",
    },
    {"objectives", "sampling", "kernels"},
    {"targets"},
    {"drafters"},
    {"serialization"},
    {"engines"},
    {"data"},
    {"decoding"},
    {"evaluation"},
    {"serving"},
    {"training"},
    {"pipeline"},
    {"api"},
    {"cli", "__main__"},
]
KNOWN: set[tuple[str, str]] = set()
# (importer package, imported package) pairs the layers allow but the house does not
FORBIDDEN = {("training", "decoding")}
# package -> importer packages that may import it but none of its modules
SEALED = {"blockdraft.objectives.edr": {"training"}}
STEPS = "blockdraft.training.steps"
MAX_STEP_PARAMETERS = 5  # self / cls not counted
# blockdraft modules a function may import: importing them loads a heavy dependency
LAZY_MODULES = {
    "blockdraft.objectives.edr.kernels": "numba and its compiled kernels",
    "blockdraft.objectives.edr.vocab_sums": "numba and its compiled kernel",
}
LAZY_MARK = "# lazy:"


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


def _package(module: str) -> str:
    """`blockdraft.training.loop` -> `training` (a top-level module names itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(module: str) -> int:
    top = _package(module)
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
        if (_package(a), _package(b)) in FORBIDDEN:
            out.add(("forbidden", f"{a} -> {b}"))
        for sealed, importers in SEALED.items():
            if b.startswith(sealed + ".") and _package(a) in importers:
                out.add(("sealed", f"{a} -> {b} (import {sealed} itself)"))
        if name is not None and name.startswith("_") and not name.startswith("__"):
            out.add(("private", f"{a} -> {b}.{name}"))
    for comp in _cycles(edges):
        out.add(("cycle", " -> ".join(comp)))
    return out


def _resolve(node: ast.ImportFrom | ast.Import, mod: str, is_pkg: bool) -> list[str]:
    """The modules (or `module.name` for from-imports) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]


def function_import_violations(src: Path, root: str = "blockdraft") -> set[tuple[str, str]]:
    """Imports inside function bodies of a module under `root` into `root` (unless of a
    `LAZY_MODULES` module), and any without a `# lazy:` mark."""
    out = set()
    for mod, (file, is_pkg) in modules(src).items():
        text = file.read_text()
        lines = text.splitlines()
        found = {}
        for fn in ast.walk(ast.parse(text, str(file))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        found[node.lineno] = node
        marked_ends: set[int] = set()
        for line, node in sorted(found.items()):
            where = f"{mod}:{line}"
            names = _resolve(node, mod, is_pkg)
            for name in names:
                inside = name == root or name.startswith(root + ".")
                if inside and not any(name == m or name.startswith(m + ".") for m in LAZY_MODULES):
                    out.add(("function-level", f"{where} imports {name}"))
            if _marked(lines, node, marked_ends):
                marked_ends.add(node.end_lineno)
            else:
                out.add(("unmarked", f"{where} imports {', '.join(names)} without {LAZY_MARK!r}"))
    return out


def _marked(lines: list[str], node: ast.stmt, marked_ends: set[int]) -> bool:
    """A `# lazy:` mark on the statement's lines, in the comment lines right above it, or
    on the marked import statement that ends right above it."""
    if any(LAZY_MARK in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
        return True
    i = node.lineno - 2  # 0-based index of the line above
    while i >= 0 and lines[i].lstrip().startswith("#"):
        if LAZY_MARK in lines[i]:
            return True
        i -= 1
    return (i + 1) in marked_ends


def test_function_level_imports_are_lazy_third_party_imports_and_say_why():
    found = function_import_violations(SRC)
    assert not found, "function-level imports:\n" + "\n".join(map(str, sorted(found)))


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # a blockdraft module imported in a function, marked or not
            {"data/a.py": "def f():\n    # lazy: no reason is good enough\n"
                          "    from blockdraft.data.b import x\n",
             "data/b.py": "x = 1\n"},
            {("function-level", "blockdraft.data.a:3 imports blockdraft.data.b.x")},
        ),
        (  # relative, and a plain `import blockdraft.errors`, unmarked
            {"drafters/m.py": "def f():\n    from .n import y\n\n"
                              "def g():\n    import blockdraft.errors\n",
             "drafters/n.py": "y = 1\n", "errors.py": ""},
            {("function-level", "blockdraft.drafters.m:2 imports blockdraft.drafters.n.y"),
             ("unmarked", "blockdraft.drafters.m:2 imports blockdraft.drafters.n.y without "
                          "'# lazy:'"),
             ("function-level", "blockdraft.drafters.m:5 imports blockdraft.errors"),
             ("unmarked", "blockdraft.drafters.m:5 imports blockdraft.errors without "
                          "'# lazy:'")},
        ),
        (  # a third-party import without the mark (in a method: functions nest)
            {"targets/t.py": "class T:\n    def f(self):\n        import yaml\n"},
            {("unmarked", "blockdraft.targets.t:3 imports yaml without '# lazy:'")},
        ),
        (  # the mark above a comment block, on the line, and shared by consecutive imports;
           # a blank line or a statement in between ends the sharing
            {"targets/t.py": "def f():\n    # lazy: slow\n    # (more why)\n"
                             "    import transformers\n    from transformers import A\n"
                             "    import datasets  # lazy: optional\n\n    import wandb\n"
                             "def g():\n    # lazy: optional\n    import gguf\n    x = 1\n"
                             "    import accelerate\n",
             "objectives/edr/recursion.py": "def k():\n    # lazy: numba\n"
                                            "    from blockdraft.objectives.edr import kernels\n",
             "objectives/edr/kernels.py": ""},
            {("unmarked", "blockdraft.targets.t:8 imports wandb without '# lazy:'"),
             ("unmarked", "blockdraft.targets.t:13 imports accelerate without '# lazy:'")},
        ),
    ],
)  # fmt: skip
def test_planted_function_level_imports_are_found(tmp_path, files, expected):
    assert function_import_violations(_tree(tmp_path, files)) == expected


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
        (  # training reaching into the decoder, which the layers alone would allow
            {"training/t.py": "from blockdraft.decoding.cpu import fast\n",
             "decoding/cpu/fast.py": ""},
            {("forbidden", "blockdraft.training.t -> blockdraft.decoding.cpu.fast")},
        ),
        (  # training reaching past a sealed package's exports, and through them (fine)
            {"training/t.py": "from blockdraft.objectives.edr.inner import f\n"
                              "from blockdraft.objectives import edr\n"
                              "from blockdraft.objectives.edr import g\n",
             "objectives/edr/inner.py": "def f(): ...\n",
             "objectives/edr/__init__.py": "from blockdraft.objectives.edr.inner import f as g\n"},
            {("sealed", "blockdraft.training.t -> blockdraft.objectives.edr.inner "
                        "(import blockdraft.objectives.edr itself)")},
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


def command_imports(src: Path) -> list[tuple[str, str]]:
    """(command module, command module it imports) for `blockdraft.cli.<command>` modules:
    the commands of `blockdraft.cli.STAGES` share helpers through their own modules
    (`cli/arguments.py`, `cli/target_options.py`, `cli/drafter_options.py`), never each
    other."""
    commands = {f"blockdraft.cli.{s.replace('-', '_')}" for s in STAGES}
    return sorted(
        (mod, dep)
        for mod, dep, _ in imports(src, "blockdraft")
        if mod in commands and dep in commands and dep != mod
    )


def test_no_command_module_imports_another():
    assert command_imports(SRC) == []


def test_a_command_importing_another_is_found(tmp_path):
    src = _tree(
        tmp_path,
        {
            "cli/__init__.py": "",
            "cli/eval.py": "X = 1\n",
            "cli/decode.py": "from blockdraft.cli.eval import X\n",
            "cli/arguments.py": "",
            "cli/suite.py": "from blockdraft.cli.arguments import Y\n",
        },
    )
    assert command_imports(src) == [("blockdraft.cli.decode", "blockdraft.cli.eval")]


def test_every_module_imports():
    """A module nobody's test imports still has to load (a stale import after a move is
    otherwise found by the first user); `__main__` runs the CLI and is left out."""
    failed = []
    for name in sorted(modules(SRC)):
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its module
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)


def wide_step_functions(src: Path, package: str = STEPS) -> set[str]:
    """`module:function (n)` for every function (methods and nested ones included) of a
    module under `package` with more than `MAX_STEP_PARAMETERS` parameters."""
    out = set()
    for mod, (file, _) in modules(src).items():
        if mod != package and not mod.startswith(package + "."):
            continue
        for fn in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            n = len([x for x in names if x not in ("self", "cls")])
            if n > MAX_STEP_PARAMETERS:
                out.add(f"{mod}:{fn.name} ({n})")
    return out


def test_training_steps_take_at_most_five_parameters():
    found = wide_step_functions(SRC)
    assert not found, "step functions with more than 5 parameters:\n" + "\n".join(sorted(found))


def test_a_wide_step_function_is_found(tmp_path):
    src = _tree(tmp_path, {
        "training/steps/s.py": "class C:\n    def ok(self, a, b, c, d, e): ...\n"
                               "def wide(a, b, c, d, *, e, f): ...\n"
                               "def outer():\n    def inner(a, b, c, d, e, *rest): ...\n",
        "training/loop.py": "def elsewhere(a, b, c, d, e, f): ...\n",
    })  # fmt: skip
    assert wide_step_functions(src) == {
        "blockdraft.training.steps.s:wide (6)",
        "blockdraft.training.steps.s:inner (6)",
    }


def test_docstring_lists_every_layer() -> None:
    """Every package of `LAYERS` is named in the module docstring, on its layer's line."""
    paragraph = next(p for p in (__doc__ or "").split("\n\n") if p.lstrip().startswith("0 "))
    listed: dict[int, set[str]] = {}
    for line in paragraph.splitlines():
        if len(line) - len(line.lstrip()) > 12:
            continue  # a description's second line
        words = line.split("(")[0].replace(",", " ").split()
        if words and words[0].isdigit():
            number, words = int(words[0]), words[1:]
        listed.setdefault(number, set()).update(words)
    listed[0] = {w.replace("blockdraft/__init__", "blockdraft") for w in listed[0]}
    assert listed == dict(enumerate(LAYERS))
