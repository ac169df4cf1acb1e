"""Offline evaluation runs: score drafters on rollout sets, evaluate, compare, write JSON.

What `blockdraft eval` / `compare` and the demo call. A drafter is a checkpoint or run
directory or a spec (`ngram[:...]`, `hybrid:PATH`, `trim:PATH`); checkpoints are scored
with the target layers their own config records, so drafters trained on other
`target.layer_ids` compare, and acceptance tensors are cached, so `compare` after
`evaluate` costs nothing.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from blockdraft.artifacts import write_new_file
from blockdraft.data.rollouts.store import RolloutSet, check_target
from blockdraft.evaluation.offline import mal_ci, offline_stats, paired_comparison
from blockdraft.evaluation.scoring import score_rollout_set, shared_target_features
from blockdraft.serialization.drafter_spec import DrafterSpec, display_name, load_drafter_spec

__all__ = [
    "benchmark_name",
    "compare",
    "drafter_names",
    "evaluate",
    "load_scored",
    "write_json",
]


def drafter_names(paths: list[DrafterSpec]) -> list[str]:
    """Short unique display names: the run directory name (parent of `final`/`best`)."""
    names = []
    for raw in paths:
        special = display_name(raw)  # `ngram[:...]`, `hybrid:...`
        if special is not None:
            names.append(special)
            continue
        p = Path(str(raw.path)).resolve()
        name = p.parent.name if p.name in ("final", "best") else p.name
        names.append(name)
    if len(set(names)) < len(names):
        return [str(p) for p in paths]
    return names


_GENERIC_DIR_NAMES = {"set", "eval", "train", "test", "rollouts", "held-out"}


def benchmark_name(rollouts: Any, rollout_dir: str | Path) -> str:
    """Display name of a rollout set in tables and plot titles: its directory name, or,
    when that says nothing (the demo's `rollouts/eval/set`), the prompt source it was
    made from (`stdlib:eval`, `gsm8k/test.jsonl:question`)."""
    name = Path(rollout_dir).resolve().name
    spec = rollouts.manifest.get("prompts", {}).get("spec")
    if name not in _GENERIC_DIR_NAMES or not spec:
        return name
    spec = str(spec)
    path, colon, field = spec.rpartition(":")
    if not colon:
        path, field = spec, ""
    if "/" not in path:  # `stdlib:eval`, `hf:org/name`, a bare file name
        return spec
    short = "/".join(Path(path).parts[-2:])
    return f"{short}:{field}" if field else short


def load_scored(
    target: Any,
    drafter_paths: list[DrafterSpec],
    rollout_dir: str | Path,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
    drafter_dtype: Any = None,
) -> tuple[Any, list[list[Any]]]:
    """Acceptance tensors of every drafter on one rollout set -> (rollout set, [per drafter]).

    Drafters are placed on the target's device, cast to `drafter_dtype` if given."""
    rollouts = RolloutSet.open(rollout_dir, allow_incomplete=allow_incomplete)
    if len(rollouts) == 0:
        raise ValueError(f"{rollout_dir}: rollout set is empty")
    check_target(rollouts, target)
    out = []
    with shared_target_features():  # one target forward per rollout for all drafters
        for path, name in zip(drafter_paths, drafter_names(drafter_paths), strict=True):
            drafter, drafter_id = load_drafter_spec(path, target, dtype=drafter_dtype)
            out.append(
                score_rollout_set(
                    drafter,
                    target,
                    rollouts,
                    drafter_id=drafter_id,
                    cache_dir=cache_dir,
                    progress=f"scoring {name}" if progress else False,
                )
            )
    return rollouts, out


def evaluate(
    target: Any,
    drafter_paths: list[DrafterSpec],
    rollout_dirs: list[str | Path],
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
    drafter_dtype: Any = None,
) -> dict[str, Any]:
    """Offline statistics of each drafter on each rollout set, as a JSON-ready dict."""
    names = drafter_names(drafter_paths)
    result: dict[str, Any] = {"target": getattr(target, "name", ""), "benchmarks": []}
    for rdir in rollout_dirs:
        rollouts, scored = load_scored(
            target, drafter_paths, rdir, cache_dir, progress, allow_incomplete, drafter_dtype
        )
        bench = {
            "name": benchmark_name(rollouts, rdir),
            "rollouts": str(rdir),
            "settings": rollouts.settings.to_dict(),
            "num_rollouts": len(rollouts),
            "drafters": [],
        }
        for name, path, acc in zip(names, drafter_paths, scored, strict=True):
            stats = offline_stats(acc)
            _, ci = mal_ci(acc, n_boot=n_boot, seed=seed)
            bench["tokens"] = stats.tokens
            bench["drafters"].append(
                {
                    "name": name,
                    "path": str(path),
                    "mal": stats.mal,
                    "mal_ci95": list(ci),
                    "expected_rounds": stats.expected_rounds,
                    "ar_k": stats.ar_k,
                    "t_ge_k": stats.t_ge_k,
                }
            )
        result["benchmarks"].append(bench)
    return result


def _json_safe(obj: Any) -> Any:
    """NaN/inf (e.g. AR_k of a slot no round reached) become null: strict JSON readers
    (JavaScript, jq, most non-Python parsers) reject Python's bare `NaN`."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy / torch scalars
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def json_text(obj: Any) -> bytes:
    """Strict JSON (no NaN), as every `--json` file is written."""
    return (json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n").encode()


def write_json(path: str | Path, obj: Any, *, overwrite: bool = True, flag: str = "--json") -> None:
    """Write strict JSON atomically, creating the parent directory; an existing file is
    refused (one line naming it) unless `overwrite`."""
    write_new_file(path, json_text(obj), flag, overwrite)


def compare(
    target: Any,
    drafter_paths: list[DrafterSpec],
    rollout_dirs: list[str | Path],
    all_pairs: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
    drafter_dtype: Any = None,
) -> list[dict[str, Any]]:
    """Paired comparisons (B vs A) per benchmark, as JSON-ready dicts: `mal_gain` is
    MAL(B) - MAL(A), `rel_gain` that over MAL(A), each with its paired 95% CI."""
    if len(drafter_paths) < 2:
        raise ValueError("compare needs at least two drafters")
    names = drafter_names(drafter_paths)
    n = len(drafter_paths)
    pairs = (
        list(itertools.combinations(range(n), 2)) if all_pairs else [(0, j) for j in range(1, n)]
    )
    out = []
    for rdir in rollout_dirs:
        rollouts, scored = load_scored(
            target, drafter_paths, rdir, cache_dir, progress, allow_incomplete, drafter_dtype
        )
        bench = benchmark_name(rollouts, rdir)
        for i, j in pairs:
            c = paired_comparison(scored[i], scored[j], n_boot=n_boot, seed=seed)
            out.append(
                {
                    "benchmark": bench,
                    "a": names[i],
                    "b": names[j],
                    "mal_a": c.mal_a,
                    "mal_b": c.mal_b,
                    "mal_gain": c.diff,
                    "mal_gain_ci95": list(c.diff_ci95),
                    "rel_gain": c.rel_gain,
                    "rel_gain_ci95": list(c.rel_gain_ci95),
                }
            )
    return out
