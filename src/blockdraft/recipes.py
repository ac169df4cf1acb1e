"""The config recipes shipped with the package: training configs and evaluation suites.

Why: `blockdraft train --config dflash-qwen3-8b` should work from any directory and from
an installed wheel. The recipes are package data (`blockdraft/configs/`, read through
`importlib.resources`; in a checkout, the repository's `configs/`). A spec is a file that
exists, else a shipped recipe (`NAME`, `NAME.yaml` or `configs/NAME.yaml`).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path, PurePath

from blockdraft.errors import UserError

TRAIN = "train"
SUITE = "suite"
# the folder of each kind, inside the package and in a checkout
_FOLDERS = {TRAIN: ("configs",), SUITE: ("configs", "suites")}


def recipe_dir(kind: str = TRAIN) -> Path:
    """The folder of the shipped recipes of `kind` (`TRAIN` or `SUITE`)."""
    return Path(str(files("blockdraft").joinpath(*_FOLDERS[kind])))


def recipe_names(kind: str = TRAIN) -> list[str]:
    """The shipped recipes of `kind`, by name (file name without `.yaml`), sorted."""
    folder = recipe_dir(kind)
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_summary(path: Path) -> str:
    """The first line of a recipe's leading comment (what it is for), or ''."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def recipe_listing(kind: str = TRAIN) -> str:
    """One line per shipped recipe of `kind`: its name and what its header says it is."""
    folder = recipe_dir(kind)
    return "\n".join(
        f"{name:<20} {recipe_summary(folder / f'{name}.yaml')}" for name in recipe_names(kind)
    )


def resolve_recipe(spec: str | Path, kind: str = TRAIN, flag: str = "--config") -> Path:
    """The file `spec` names: an existing path, else the shipped recipe of that name
    (`flag` names the option in the error)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    pure = PurePath(str(spec))
    # a bare name, or the checkout's own path to a recipe (`configs/tiny.yaml`)
    if pure.parent == PurePath(".") or pure.parent.parts[-len(_FOLDERS[kind]) :] == _FOLDERS[kind]:
        name = pure.name.removesuffix(".yaml")
        shipped = recipe_dir(kind) / f"{name}.yaml"
        if shipped.is_file():
            return shipped
    names = ", ".join(recipe_names(kind)) or "none"
    raise UserError(f"{flag} {spec}: no such file and no shipped recipe of that name ({names})")
