"""docs/configuration.md lists every training config key with its default, and nothing else.

The page is written by hand; this test ties it to the dataclasses in
`blockdraft/training/config.py`, so a new field, a renamed one or a changed default fails
here until the page says so.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from blockdraft.objectives.registry import parameter_defaults
from blockdraft.training.config import ObjectiveConfig, TrainConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([\w.]+)` \| `([^`]*)` \|", re.M)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def config_keys(cls: type = TrainConfig, prefix: str = "") -> dict[str, str]:
    """Dotted key -> default as JSON, for every leaf field of the config (the objective
    section: every registered objective's parameters)."""
    keys = {}
    for f in dataclasses.fields(cls):
        if cls is ObjectiveConfig and f.name == "params":
            keys.update({f"{prefix}{k}": json.dumps(v) for k, v in parameter_defaults().items()})
            continue
        value = _default(f)
        if dataclasses.is_dataclass(value):
            keys.update(config_keys(type(value), f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = json.dumps(value)
    return keys


def documented_keys(text: str) -> dict[str, str]:
    return dict(ROW.findall(text))


def test_row_pattern_reads_the_page_format() -> None:
    text = "| `optim.lr` | `0.0006` | peak AdamW learning rate |\n| key | default | meaning |\n"
    assert documented_keys(text) == {"optim.lr": "0.0006"}


def test_every_config_key_is_documented_with_its_default() -> None:
    documented = documented_keys(PAGE.read_text(encoding="utf-8"))
    actual = config_keys()
    missing = sorted(set(actual) - set(documented))
    stale = sorted(set(documented) - set(actual))
    wrong = sorted(k for k in set(actual) & set(documented) if actual[k] != documented[k])
    assert not missing, f"docs/configuration.md lacks: {missing}"
    assert not stale, f"docs/configuration.md documents keys that do not exist: {stale}"
    assert not wrong, "defaults differ: " + ", ".join(
        f"{k} is {actual[k]}, page says {documented[k]}" for k in wrong
    )
