"""`blockdraft eval --target NAME --rollouts DIR DRAFTER [DRAFTER...] [--json OUT]`.

(`--rollouts` may be repeated: one benchmark per rollout set.)

Exact offline evaluation (METHODS.md §3) of each drafter on each rollout set (one
"benchmark" per set): expected rounds, MAL with a bootstrap CI, AR_k and T_{>=k}.
Acceptance tensors are cached per (drafter checkpoint, rollouts), so `compare` and
`report` after `eval` cost nothing. `evaluate()` is the same as a Python function.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockdraft.models.drafter_spec import checkpoint_of, display_name, load_drafter_spec
from blockdraft.threads import add_threads_arg, apply_threads


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter checkpoint directory: `path` itself, or `path/final` for a run directory."""
    p = Path(path)
    for cand in (p, p / "final"):
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError(
        f"{path}: not a drafter checkpoint (no config.json in it or in {p / 'final'})"
    )


def drafter_names(paths: list[str | Path]) -> list[str]:
    """Short unique display names: the run directory name (parent of `final`/`best`)."""
    names = []
    for raw in paths:
        special = display_name(raw)  # `ngram[:...]`, `hybrid:...`
        if special is not None:
            names.append(special)
            continue
        p = Path(raw).resolve()
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
    drafter_paths: list[str | Path],
    rollout_dir: str | Path,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
) -> tuple[Any, list[list[Any]]]:
    """Acceptance tensors of every drafter on one rollout set -> (rollout set, [per drafter])."""
    from blockdraft.data.rollout_store import RolloutSet, check_target
    from blockdraft.evaluation.scoring import score_rollout_set

    rollouts = RolloutSet.open(rollout_dir, allow_incomplete=allow_incomplete)
    if len(rollouts) == 0:
        raise ValueError(f"{rollout_dir}: rollout set is empty")
    check_target(rollouts, target)
    out = []
    for path, name in zip(drafter_paths, drafter_names(drafter_paths), strict=True):
        drafter, drafter_id = load_drafter_spec(path, target)
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
    drafter_paths: list[str | Path],
    rollout_dirs: list[str | Path],
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
) -> dict[str, Any]:
    """Offline statistics of each drafter on each rollout set, as a JSON-ready dict."""
    from blockdraft.evaluation.offline import mal_ci, offline_stats

    names = drafter_names(drafter_paths)
    result: dict[str, Any] = {"target": getattr(target, "name", ""), "benchmarks": []}
    for rdir in rollout_dirs:
        rollouts, scored = load_scored(
            target, drafter_paths, rdir, cache_dir, progress, allow_incomplete
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


def eval_markdown(result: dict[str, Any]) -> str:
    from blockdraft.report import _offline_table, drafters_from_eval

    return "\n".join(_offline_table(drafters_from_eval(result)))


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", required=True, help="target name (tiny, gemma-3-270m) or HF model path"
    )
    p.add_argument("--cache-dir", default=None, help="acceptance cache (default: user cache dir)")
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def setup_target(args: argparse.Namespace) -> Any:
    apply_threads(args.threads)
    from blockdraft.models.registry import load_target

    return load_target(args.target, progress=not args.no_progress)


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


def write_json(path: str | Path, obj: Any) -> None:
    """Write strict JSON (no NaN), creating the parent directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="exact offline evaluation of drafters on target rollouts",
        description="Expected rounds, MAL (+bootstrap CI), AR_k and T_{>=k} of each drafter on "
        "each "
        "rollout set, computed exactly from the rollouts without running speculative decoding.",
    )
    add_target_args(p)
    p.add_argument(
        "--rollouts",
        required=True,
        action="append",
        help="rollout directory (a benchmark); repeat for several",
    )
    p.add_argument(
        "drafters",
        nargs="+",
        help="drafter checkpoint directories (or run dirs with final/); `ngram` or "
        "`ngram:k=7,max=3,min=1` for the prompt-lookup baseline",
    )
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def add_allow_incomplete(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="score rollout sets whose `blockdraft rollout` was interrupted (refused otherwise)",
    )


def run_scored_command(
    args: argparse.Namespace,
    compute: Callable[[Any], Any],
    markdown: Callable[[Any], str],
    json_obj: Callable[[Any], Any],
) -> int:
    """Shared body of `eval` and `compare`: check the checkpoints, load the target, compute,
    print markdown, optionally write JSON; bad input is a one-line error and exit code 2."""
    try:
        for d in args.drafters:
            checkpoint_of(d)
        result = compute(setup_target(args))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.json:
        write_json(args.json, json_obj(result))
        print(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    return run_scored_command(
        args,
        lambda target: evaluate(
            target, args.drafters, args.rollouts, args.n_boot, args.seed, args.cache_dir,
            progress=not args.no_progress, allow_incomplete=args.allow_incomplete,
        ),
        eval_markdown,
        lambda result: result,
    )
