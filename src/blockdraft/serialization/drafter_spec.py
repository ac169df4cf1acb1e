"""What a user may type where a drafter is expected, resolved in one place.

`eval`, `compare`, `decode`, `report` and the demo accept the same three forms:

- a checkpoint directory, or a run directory holding `final/`;
- `ngram` or `ngram:k=7,max=3,min=1[,match=first]`: prompt lookup, no checkpoint;
- `hybrid:PATH` or `hybrid:conf=0.3:PATH`: the drafter at PATH with prompt lookup as a
  per-slot fallback (`drafters/hybrid.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from blockdraft.drafters.hybrid import HybridDrafter, parse_hybrid_spec
from blockdraft.drafters.ngram import NgramDrafter, parse_drafter_spec
from blockdraft.serialization.checkpoint import checkpoint_hash, load_drafter, resolve_checkpoint


def checkpoint_of(spec: str | Path) -> Path | None:
    """The checkpoint directory a spec names (None for `ngram`); raises if it is missing."""
    if parse_drafter_spec(spec) is not None:
        return None
    hybrid = parse_hybrid_spec(spec)
    return resolve_checkpoint(hybrid[0] if hybrid else spec)


def load_drafter_spec(
    spec: str | Path, target: Any, dtype: torch.dtype | None = None
) -> tuple[Any, str | None]:
    """(drafter in eval mode, identity for the scoring cache or None) for a spec.

    The drafter is placed on the target's device (it reads the target's features and
    shares its embedding and head), cast to `dtype` if given (else the checkpoint's).
    Checkpoints adopt their own target layer ids (a drafter trained on `[0,1,2,3]` is
    scored on those layers); load each drafter right before using it."""
    ngram = parse_drafter_spec(spec)
    if ngram is not None:
        return ngram, None
    ckpt = checkpoint_of(spec)
    assert ckpt is not None
    drafter = load_drafter(ckpt, target, device=target.device, adopt_layer_ids=True).eval()
    if dtype is not None:
        drafter.to(dtype)
    hybrid = parse_hybrid_spec(spec)
    if hybrid is not None:
        k = int(drafter.config.num_proposals)
        return HybridDrafter(drafter, NgramDrafter(k), min_confidence=hybrid[1]), checkpoint_hash(
            ckpt
        )
    return drafter, checkpoint_hash(ckpt)


def display_name(spec: str | Path) -> str | None:
    """The name a non-path spec shows in tables (None for plain paths)."""
    if parse_drafter_spec(spec) is not None:
        return str(spec)
    hybrid = parse_hybrid_spec(spec)
    if hybrid is not None:
        p = Path(hybrid[0]).resolve()
        base = p.parent.name if p.name in ("final", "best") else p.name
        return f"{base}+ngram" + (f"@{hybrid[1]:g}" if str(spec).startswith("hybrid:conf") else "")
    return None
