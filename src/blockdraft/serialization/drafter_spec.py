"""What a user may type where a drafter is expected, parsed once into a `DrafterSpec`.

`eval`, `compare`, `suite`, `decode`, `report` and the demo accept the same forms:

- a checkpoint directory, or a run directory holding `final/`;
- `ngram` or `ngram:k=7,max=3,min=1[,match=first]`: prompt lookup, no checkpoint;
- `suffix` or `suffix:k=7,depth=24,factor=1,prob=0.1[,global=1]`: suffix decoding
  (vLLM's `method: suffix`, `drafters/suffix.py`), no checkpoint;
- `hybrid:PATH` or `hybrid:conf=0.3:PATH`: the drafter at PATH with prompt lookup as a
  per-slot fallback (`drafters/hybrid.py`);
- `trim:PATH` or `trim:conf=0.3:PATH`: the drafter at PATH proposing only the prefix of
  each block before its first slot below that confidence (`drafters/trimmed.py`).

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
from blockdraft.drafters.suffix import SuffixDrafter
from blockdraft.drafters.trimmed import DEFAULT_TRIM_CONFIDENCE, TrimmedDrafter
from blockdraft.errors import BlockdraftError
from blockdraft.serialization.checkpoint import checkpoint_hash, load_drafter, resolve_checkpoint

NGRAM_KEYS = {"k": "num_proposals", "max": "max_ngram", "min": "min_ngram", "match": "match"}
NGRAM_FORM = "ngram[:k=K,max=N,min=M,match=first|latest]"
SUFFIX_KEYS = {
    "k": "num_proposals",
    "depth": "max_depth",
    "factor": "max_spec_factor",
    "prob": "min_token_prob",
    "global": "global_tree",
}
SUFFIX_FORM = "suffix[:k=K,depth=D,factor=F,prob=P,global=0|1]"
HYBRID_FORM = "hybrid[:conf=C]:PATH"
TRIM_FORM = "trim[:conf=C]:PATH"
CONFIDENCE_KINDS = ("hybrid", "trim")  # a checkpoint with a per-slot confidence rule
LOOKUP_KINDS = ("ngram", "suffix")  # drafters made from token ids alone: no checkpoint


class DrafterSpecError(BlockdraftError, ValueError):
    """Text that is none of the drafter spec forms; the message quotes it."""


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter as typed: `kind` is `checkpoint`, `ngram`, `suffix`, `hybrid` or `trim`;
    `path` the checkpoint or run directory as typed (None for `ngram` and `suffix`);
    `options` the `key=value` pairs (ngram's k/max/min/match, suffix's
    k/depth/factor/prob/global, hybrid's and trim's conf) in the order typed, so `str()`
    gives the text back."""

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
        if kind in LOOKUP_KINDS:
            pairs = [p.partition("=") for p in rest.split(",") if p.strip()]
            spec = cls(kind, None, tuple((k.strip(), v.strip()) for k, _, v in pairs))
            spec.lookup_drafter(raw)  # checked now, not when the drafter is first used
        elif kind in CONFIDENCE_KINDS and colon:
            conf, _, path = rest.partition(":") if rest.startswith("conf=") else ("", "", rest)
            spec = cls(kind, path, (("conf", conf[len("conf=") :]),) if conf else ())
            if not path:
                form = HYBRID_FORM if kind == "hybrid" else TRIM_FORM
                raise DrafterSpecError(f"bad drafter spec {raw!r}: expected {form}")
            spec.min_confidence  # noqa: B018 - checked now, not when the drafter loads
        elif not raw:
            raise DrafterSpecError(
                f"empty drafter spec: expected a checkpoint or run directory, {NGRAM_FORM}, "
                f"{SUFFIX_FORM}, {HYBRID_FORM} or {TRIM_FORM}"
            )
        else:
            spec = cls("checkpoint", raw)
        return spec

    @classmethod
    def lookup(cls, num_proposals: int) -> DrafterSpec:
        """Prompt lookup proposing `num_proposals` tokens, named as the drafter names itself."""
        return cls.parse(NgramDrafter(num_proposals=num_proposals).name)

    @classmethod
    def suffix(cls, num_proposals: int) -> DrafterSpec:
        """Suffix decoding proposing up to `num_proposals` tokens (vLLM's other settings)."""
        return cls.parse(SuffixDrafter(num_proposals=num_proposals).name)

    def with_proposals(self, num_proposals: int) -> DrafterSpec:
        """A bare `ngram` or `suffix` spec made to propose `num_proposals` tokens (so a
        free baseline is not handicapped by a shorter block); any other spec unchanged."""
        if self.options or self.kind not in LOOKUP_KINDS:
            return self
        return self.lookup(num_proposals) if self.kind == "ngram" else self.suffix(num_proposals)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        if self.kind in LOOKUP_KINDS:
            return f"{self.kind}:{opts}" if opts else self.kind
        if self.kind in CONFIDENCE_KINDS:
            return f"{self.kind}:" + "".join(f"{k}={v}:" for k, v in self.options) + str(self.path)
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

    def suffix_drafter(self, text: str | None = None) -> SuffixDrafter:
        """The suffix-decoding drafter a `suffix` spec describes (errors quote `text`)."""
        quoted = repr(str(self) if text is None else text)
        kwargs: dict[str, Any] = {}
        for key, value in self.options:
            try:
                kwargs[SUFFIX_KEYS[key]] = _suffix_value(key, value)
            except (KeyError, ValueError):
                raise DrafterSpecError(
                    f"bad drafter spec {quoted}: expected {SUFFIX_FORM}"
                ) from None
        try:
            return SuffixDrafter(**kwargs)
        except ValueError as exc:
            raise DrafterSpecError(f"bad drafter spec {quoted}: {exc}") from None

    def lookup_drafter(self, text: str | None = None) -> NgramDrafter | SuffixDrafter:
        """The drafter an `ngram` or `suffix` spec describes."""
        return self.ngram(text) if self.kind == "ngram" else self.suffix_drafter(text)

    @property
    def min_confidence(self) -> float:
        """A `hybrid` or `trim` spec's confidence threshold (`conf`, default 0.3)."""
        conf = dict(self.options).get("conf")
        default = DEFAULT_MIN_CONFIDENCE if self.kind == "hybrid" else DEFAULT_TRIM_CONFIDENCE
        try:
            value = default if conf is None else float(conf)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise DrafterSpecError(f"bad drafter spec {str(self)!r}: conf must be in [0, 1]")
        return value


def _suffix_value(key: str, value: str) -> bool | int | float:
    """One `suffix` option's value: `global` 0 or 1, `k` and `depth` integers, else a float."""
    if key == "global":
        if value not in ("0", "1"):
            raise ValueError(value)
        return value == "1"
    return int(value) if key in ("k", "depth") else float(value)


def _typed(spec: Any) -> DrafterSpec:
    if not isinstance(spec, DrafterSpec):
        raise TypeError(
            f"expected a DrafterSpec (DrafterSpec.parse where text enters), got {spec!r}"
        )
    return spec


def checkpoint_of(spec: DrafterSpec) -> Path | None:
    """The checkpoint directory a spec names (None for `ngram`, `suffix`); raises if missing."""
    return None if _typed(spec).kind in LOOKUP_KINDS else resolve_checkpoint(str(spec.path))


def load_drafter_spec(
    spec: DrafterSpec, target: Any, dtype: torch.dtype | None = None
) -> tuple[Any, str | None]:
    """(drafter in eval mode, identity for the scoring cache or None) for a spec.

    The drafter is placed on the target's device (it reads the target's features and
    shares its embedding and head), cast to `dtype` if given (else the checkpoint's).
    Checkpoints adopt their own target layer ids (a drafter trained on `[0,1,2,3]` is
    scored on those layers); load each drafter right before using it."""
    if _typed(spec).kind in LOOKUP_KINDS:
        return spec.lookup_drafter(), None
    ckpt = checkpoint_of(spec)
    assert ckpt is not None
    drafter = load_drafter(ckpt, target, device=target.device, adopt_layer_ids=True).eval()
    if dtype is not None:
        drafter.to(dtype)
    if spec.kind == "hybrid":
        k = int(drafter.config.num_proposals)
        hybrid = HybridDrafter(drafter, NgramDrafter(k), min_confidence=spec.min_confidence)
        return hybrid, checkpoint_hash(ckpt)
    if spec.kind == "trim":
        return TrimmedDrafter(drafter, spec.min_confidence), checkpoint_hash(ckpt)
    return drafter, checkpoint_hash(ckpt)


def display_name(spec: DrafterSpec) -> str | None:
    """The name a non-path spec shows in tables (None for plain paths)."""
    if _typed(spec).kind in LOOKUP_KINDS:
        return str(spec)
    if spec.kind in CONFIDENCE_KINDS:
        p = Path(str(spec.path)).resolve()
        base = p.parent.name if p.name in ("final", "best") else p.name
        if spec.kind == "trim":
            return f"{base}+trim@{spec.min_confidence:g}"
        return f"{base}+ngram" + (f"@{spec.min_confidence:g}" if spec.options else "")
    return None
