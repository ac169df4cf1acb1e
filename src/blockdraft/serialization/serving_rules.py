"""What an export asks of an engine beyond the DFlash format: the prompt lookups its
blocks read, and where its blocks end.

Why: a `lookup_inputs` drafter's proposal slots read prompt lookup's tokens, a `hybrid`
spec gives low-confidence slots the looked-up token, and a `trim` spec proposes only the
slots before the first low-confidence one; the DFlash format has no words for any of
them, so an engine that knows only the format would serve the bare drafter, still
lossless but another drafter than the one scored. Such an export is therefore named
`DFlashLookupDraftModel` (`LOOKUP_ARCHITECTURE`), which only blockdraft's vLLM plugin
registers (an engine without it refuses the directory), and it carries the rules under
`blockdraft.serving` in config.json:

    "serving": {"lookup_inputs": {"k": 7, "max": 3, "min": 1, "match": "latest"},
                "hybrid": {"conf": 0.3,
                           "lookup": {"k": 7, "max": 3, "min": 1, "match": "first"}},
                "trim": {"conf": 0.3}}

(`hybrid` and `trim` exclude each other.) Each lookup runs over a request's verified
tokens, the anchor included, as in training and in the offline evaluator (docs/export.md,
"Lookup-aware drafters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockdraft.drafters.lookup_inputs import lookup_rule
from blockdraft.drafters.ngram import NgramConfig, NgramDrafter
from blockdraft.errors import CheckpointError

LOOKUP_ARCHITECTURE = "DFlashLookupDraftModel"
SECTION = "serving"
_RULE_KEYS = {"k": "num_proposals", "max": "max_ngram", "min": "min_ngram", "match": "match"}


@dataclass(frozen=True)
class ServingRules:
    """The rules of one served drafter: `inputs` (the lookup its K slots read, None for a
    plain drafter), `hybrid_conf` + `hybrid_lookup` (the per-slot fallback, None without
    one) and `trim_conf` (the confidence below which a block ends, None: all K proposed)."""

    inputs: NgramConfig | None = None
    hybrid_conf: float | None = None
    hybrid_lookup: NgramConfig | None = None
    trim_conf: float | None = None

    @classmethod
    def of(
        cls,
        num_proposals: int,
        lookup_inputs: bool,
        hybrid_conf: float | None,
        trim_conf: float | None = None,
    ) -> ServingRules | None:
        """The rules a drafter with K = `num_proposals` needs (None: a plain drafter)."""
        if not lookup_inputs and hybrid_conf is None and trim_conf is None:
            return None
        if hybrid_conf is not None and trim_conf is not None:
            raise ValueError("a drafter is served with a hybrid fallback or trimmed, not both")
        inputs = lookup_rule(num_proposals).config if lookup_inputs else None
        hybrid = None if hybrid_conf is None else NgramDrafter(num_proposals).config
        return cls(inputs, hybrid_conf, hybrid, trim_conf)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.inputs is not None:
            out["lookup_inputs"] = _rule_json(self.inputs)
        if self.hybrid_conf is not None and self.hybrid_lookup is not None:
            out["hybrid"] = {"conf": self.hybrid_conf, "lookup": _rule_json(self.hybrid_lookup)}
        if self.trim_conf is not None:
            out["trim"] = {"conf": self.trim_conf}
        return out

    @classmethod
    def read(cls, namespace: Any, source: str) -> ServingRules | None:
        """The section in config.json's `blockdraft` mapping (None when absent); a
        malformed one is a `CheckpointError` naming `source` and the key."""
        section = namespace.get(SECTION) if isinstance(namespace, dict) else None
        if section is None:
            return None
        where = f"{source}: blockdraft.{SECTION}"
        if not isinstance(section, dict) or not set(section) <= {"lookup_inputs", "hybrid", "trim"}:
            raise CheckpointError(
                f"{where}: expected a mapping of lookup_inputs, hybrid and/or trim"
            )
        inputs = section.get("lookup_inputs")
        inputs = None if inputs is None else _rule(inputs, f"{where}.lookup_inputs")
        hybrid = section.get("hybrid")
        conf, lookup = None, None
        if hybrid is not None:
            if not isinstance(hybrid, dict) or set(hybrid) != {"conf", "lookup"}:
                raise CheckpointError(f"{where}.hybrid: expected {{conf, lookup}}")
            conf = _confidence(hybrid["conf"], f"{where}.hybrid.conf")
            lookup = _rule(hybrid["lookup"], f"{where}.hybrid.lookup")
        trim = section.get("trim")
        trim_conf = None
        if trim is not None:
            if not isinstance(trim, dict) or set(trim) != {"conf"}:
                raise CheckpointError(f"{where}.trim: expected {{conf}}")
            trim_conf = _confidence(trim["conf"], f"{where}.trim.conf")
        if inputs is None and conf is None and trim_conf is None:
            raise CheckpointError(f"{where}: names none of lookup_inputs, hybrid, trim")
        if conf is not None and trim_conf is not None:
            raise CheckpointError(f"{where}: hybrid and trim exclude each other")
        return cls(inputs, conf, lookup, trim_conf)


def _confidence(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheckpointError(f"{where}: {value!r} is not a number in [0, 1]")
    return float(value)


def _rule_json(rule: NgramConfig) -> dict[str, Any]:
    return {key: getattr(rule, field) for key, field in _RULE_KEYS.items()}


def _rule(data: Any, where: str) -> NgramConfig:
    if not isinstance(data, dict) or set(data) != set(_RULE_KEYS):
        raise CheckpointError(f"{where}: expected {{{', '.join(_RULE_KEYS)}}}")
    try:
        return NgramDrafter(**{field: data[key] for key, field in _RULE_KEYS.items()}).config
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


__all__ = ["LOOKUP_ARCHITECTURE", "SECTION", "ServingRules"]
