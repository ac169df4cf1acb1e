"""What a lookup-aware export asks of an engine: the prompt lookups its blocks read.

Why: a `lookup_inputs` drafter's proposal slots read prompt lookup's tokens, and a
`hybrid` spec gives low-confidence slots the looked-up token; the DFlash format has no
words for either, so an engine that knows only the format would serve the bare drafter,
still lossless but another drafter than the one scored. Such an export is therefore named
`DFlashLookupDraftModel` (`LOOKUP_ARCHITECTURE`), which only blockdraft's vLLM plugin
registers (an engine without it refuses the directory), and it carries the rules under
`blockdraft.serving` in config.json:

    "serving": {"lookup_inputs": {"k": 7, "max": 3, "min": 1, "match": "latest"},
                "hybrid": {"conf": 0.3,
                           "lookup": {"k": 7, "max": 3, "min": 1, "match": "first"}}}

Each lookup runs over a request's verified tokens, the anchor included, as in training
and in the offline evaluator (docs/export.md, "Lookup-aware drafters").
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
class LookupServing:
    """The lookups of one served drafter: `inputs` (what its K slots read, None for a
    plain drafter) and `hybrid_conf` + `hybrid_lookup` (the per-slot fallback, None
    without one)."""

    inputs: NgramConfig | None = None
    hybrid_conf: float | None = None
    hybrid_lookup: NgramConfig | None = None

    @classmethod
    def of(
        cls, num_proposals: int, lookup_inputs: bool, hybrid_conf: float | None
    ) -> LookupServing | None:
        """The lookups a drafter with K = `num_proposals` needs (None: a plain drafter)."""
        if not lookup_inputs and hybrid_conf is None:
            return None
        inputs = lookup_rule(num_proposals).config if lookup_inputs else None
        hybrid = None if hybrid_conf is None else NgramDrafter(num_proposals).config
        return cls(inputs, hybrid_conf, hybrid)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.inputs is not None:
            out["lookup_inputs"] = _rule_json(self.inputs)
        if self.hybrid_conf is not None and self.hybrid_lookup is not None:
            out["hybrid"] = {"conf": self.hybrid_conf, "lookup": _rule_json(self.hybrid_lookup)}
        return out

    @classmethod
    def read(cls, namespace: Any, source: str) -> LookupServing | None:
        """The section in config.json's `blockdraft` mapping (None when absent); a
        malformed one is a `CheckpointError` naming `source` and the key."""
        section = namespace.get(SECTION) if isinstance(namespace, dict) else None
        if section is None:
            return None
        where = f"{source}: blockdraft.{SECTION}"
        if not isinstance(section, dict) or not set(section) <= {"lookup_inputs", "hybrid"}:
            raise CheckpointError(f"{where}: expected a mapping of lookup_inputs and/or hybrid")
        inputs = section.get("lookup_inputs")
        inputs = None if inputs is None else _rule(inputs, f"{where}.lookup_inputs")
        hybrid = section.get("hybrid")
        conf, lookup = None, None
        if hybrid is not None:
            if not isinstance(hybrid, dict) or set(hybrid) != {"conf", "lookup"}:
                raise CheckpointError(f"{where}.hybrid: expected {{conf, lookup}}")
            conf = hybrid["conf"]
            if isinstance(conf, bool) or not isinstance(conf, (int, float)) or not 0 <= conf <= 1:
                raise CheckpointError(f"{where}.hybrid.conf: {conf!r} is not a number in [0, 1]")
            lookup = _rule(hybrid["lookup"], f"{where}.hybrid.lookup")
        if inputs is None and conf is None:
            raise CheckpointError(f"{where}: names neither lookup_inputs nor hybrid")
        return cls(inputs, None if conf is None else float(conf), lookup)


def _rule_json(rule: NgramConfig) -> dict[str, Any]:
    return {key: getattr(rule, field) for key, field in _RULE_KEYS.items()}


def _rule(data: Any, where: str) -> NgramConfig:
    if not isinstance(data, dict) or set(data) != set(_RULE_KEYS):
        raise CheckpointError(f"{where}: expected {{{', '.join(_RULE_KEYS)}}}")
    try:
        return NgramDrafter(**{field: data[key] for key, field in _RULE_KEYS.items()}).config
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


__all__ = ["LOOKUP_ARCHITECTURE", "SECTION", "LookupServing"]
