"""What a user may type where a drafter is expected, parsed once into a `DrafterSpec`.

`eval`, `compare`, `suite`, `decode`, `report` and the demo accept the same three forms:

- a checkpoint directory, or a run directory holding `final/`;
- `ngram` or `ngram:k=7,max=3,min=1[,match=first]`: prompt lookup, no checkpoint;
- `hybrid:PATH` or `hybrid:conf=0.3:PATH`: the drafter at PATH with prompt lookup as a
  per-slot fallback (`drafters/hybrid.py`).

Why one type: the text is parsed where it enters (the command line, a suite file, the
Python API) and everything below takes the `DrafterSpec`, so a bad spec is one error
before any model loads and no later stage reads the syntax again.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockdraft.drafters.hybrid import DEFAULT_MIN_CONFIDENCE, HybridDrafter
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.errors import BlockdraftError
from blockdraft.serialization.checkpoint import checkpoint_hash, load_drafter, resolve_checkpoint

NGRAM_KEYS = {"k": "num_proposals", "max": "max_ngram", "min": "min_ngram", "match": "match"}
NGRAM_FORM = "ngram[:k=K,max=N,min=M,match=first|latest]"
HYBRID_FORM = "hybrid[:conf=C]:PATH"


class DrafterSpecError(BlockdraftError, ValueError):
    """Text that is none of the drafter spec forms; the message quotes it."""


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter as typed: `kind` is `checkpoint`, `ngram` or `hybrid`; `path` the
    checkpoint or run directory as typed (None for `ngram`); `options` the `key=value`
    pairs (ngram's k/max/min/match, hybrid's conf) in the order typed, so `str()` gives
    the text back."""

    kind: str = "checkpoint"
    path: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str | os.PathLike[str] | DrafterSpec) -> DrafterSpec:
        """The spec `text` names; `DrafterSpecError` (one line) if it names none."""
        if isinstance(text, DrafterSpec):
            return text
        raw = os.fspath(text)
        kind, colon, rest = raw.partition(":")
        if kind == "ngram":
            pairs = [p.partition("=") for p in rest.split(",") if p.strip()]
            spec = cls("ngram", None, tuple((k.strip(), v.strip()) for k, _, v in pairs))
            spec.ngram(raw)  # checked now, not when the drafter is first used
        elif kind == "hybrid" and colon:
            conf, _, path = rest.partition(":") if rest.startswith("conf=") else ("", "", rest)
            spec = cls("hybrid", path, (("conf", conf[len("conf=") :]),) if conf else ())
            if not path:
                raise DrafterSpecError(f"bad drafter spec {raw!r}: expected {HYBRID_FORM}")
            spec.min_confidence  # noqa: B018 - checked now, not when the drafter loads
        elif not raw:
            raise DrafterSpecError(
                f"empty drafter spec: expected a checkpoint or run directory, {NGRAM_FORM} "
                f"or {HYBRID_FORM}"
            )
        else:
            spec = cls("checkpoint", raw)
        return spec

    @classmethod
    def lookup(cls, num_proposals: int) -> DrafterSpec:
        """Prompt lookup proposing `num_proposals` tokens, named as the drafter names itself."""
        return cls.parse(NgramDrafter(num_proposals=num_proposals).name)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        if self.kind == "ngram":
            return f"ngram:{opts}" if opts else "ngram"
        if self.kind == "hybrid":
            return "hybrid:" + "".join(f"{k}={v}:" for k, v in self.options) + str(self.path)
        return str(self.path)

    def ngram(self, text: str | None = None) -> NgramDrafter:
        """The prompt-lookup drafter an `ngram` spec describes (errors quote `text`, the
        spec as typed, if given)."""
        quoted = repr(str(self) if text is None else text)
        kwargs: dict[str, Any] = {}
        for key, value in self.options:
            if key not in NGRAM_KEYS or key != "match" and not value.isdecimal():
                raise DrafterSpecError(f"bad drafter spec {quoted}: expected {NGRAM_FORM}")
            kwargs[NGRAM_KEYS[key]] = value if key == "match" else int(value)
        try:
            return NgramDrafter(**kwargs)
        except ValueError as exc:
            raise DrafterSpecError(f"bad drafter spec {quoted}: {exc}") from None

    @property
    def min_confidence(self) -> float:
        """A `hybrid` spec's confidence threshold (`conf`, default 0.3)."""
        conf = dict(self.options).get("conf")
        try:
            value = DEFAULT_MIN_CONFIDENCE if conf is None else float(conf)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise DrafterSpecError(f"bad drafter spec {str(self)!r}: conf must be in [0, 1]")
        return value


def _typed(spec: Any) -> DrafterSpec:
    if not isinstance(spec, DrafterSpec):
        raise TypeError(
            f"expected a DrafterSpec (DrafterSpec.parse where text enters), got {spec!r}"
        )
    return spec


def checkpoint_of(spec: DrafterSpec) -> Path | None:
    """The checkpoint directory a spec names (None for `ngram`); raises if it is missing."""
    return None if _typed(spec).kind == "ngram" else resolve_checkpoint(str(spec.path))


def load_drafter_spec(
    spec: DrafterSpec, target: Any, dtype: torch.dtype | None = None
) -> tuple[Any, str | None]:
    """(drafter in eval mode, identity for the scoring cache or None) for a spec.

    The drafter is placed on the target's device (it reads the target's features and
    shares its embedding and head), cast to `dtype` if given (else the checkpoint's).
    Checkpoints adopt their own target layer ids (a drafter trained on `[0,1,2,3]` is
    scored on those layers); load each drafter right before using it."""
    if _typed(spec).kind == "ngram":
        return spec.ngram(), None
    ckpt = checkpoint_of(spec)
    assert ckpt is not None
    drafter = load_drafter(ckpt, target, device=target.device, adopt_layer_ids=True).eval()
    if dtype is not None:
        drafter.to(dtype)
    if spec.kind == "hybrid":
        k = int(drafter.config.num_proposals)
        hybrid = HybridDrafter(drafter, NgramDrafter(k), min_confidence=spec.min_confidence)
        return hybrid, checkpoint_hash(ckpt)
    return drafter, checkpoint_hash(ckpt)


def display_name(spec: DrafterSpec) -> str | None:
    """The name a non-path spec shows in tables (None for plain paths)."""
    if _typed(spec).kind == "ngram":
        return str(spec)
    if spec.kind == "hybrid":
        p = Path(str(spec.path)).resolve()
        base = p.parent.name if p.name in ("final", "best") else p.name
        return f"{base}+ngram" + (f"@{spec.min_confidence:g}" if spec.options else "")
    return None
