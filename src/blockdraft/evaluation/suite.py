"""A benchmark suite: several held-out prompt sets scored in one call, as papers report them.

A user serves a mix of domains, so one held-out set says little: a suite names several
(GSM8K, HumanEval, MT-Bench, any prompt file), caches each set's target rollouts, and
scores every drafter on every set and on the mean over sets, next to the baseline (prompt
lookup by default). Suite files are YAML: docs/evaluation.md and `configs/suites/`.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.data.rollouts.store import read_manifest
from blockdraft.errors import BlockdraftError
from blockdraft.evaluation.eval_compare import drafter_names, load_scored
from blockdraft.evaluation.lookup_split import lookup_split
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.suite_statistics import BenchmarkRounds, suite_statistics
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.checkpoint import read_config
from blockdraft.serialization.drafter_spec import DrafterSpec, DrafterSpecError, checkpoint_of
from blockdraft.targets.registry import target_fingerprint
from blockdraft.user_cache import cache_root, stable_hash

SELECTIONS = ("first", "spread")
_SUITE_KEYS = {"name", "data_dir", "baseline", "rollouts", "benchmarks"}
_BENCH_KEYS = {"name", "prompts", "limit", "select"}
_ROLLOUT_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "seed", "batch_size"}


class SuiteError(BlockdraftError, ValueError):
    """A suite file or benchmark argument is malformed; the message names the file and key."""


@dataclass(frozen=True)
class Benchmark:
    """One held-out set: a prompt spec (`data.prompt_specs`), how many prompts and which."""

    name: str
    prompts: str
    limit: int | None = None
    select: str = "first"  # first: file order | spread: evenly spaced over the whole file


@dataclass
class Suite:
    """Benchmarks plus the rollout settings they share and the baseline every row is paired with."""

    name: str
    benchmarks: list[Benchmark]
    sampling: SamplingSettings = field(default_factory=lambda: SamplingSettings(temperature=0.0))
    batch_size: int = 16
    baseline: DrafterSpec = DrafterSpec("ngram")


def _known_keys(raw: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise SuiteError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SuiteError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _benchmark(raw: Any, where: str, data_dir: Path | None) -> Benchmark:
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: a benchmark is a mapping with name and prompts")
    _known_keys(raw, _BENCH_KEYS, where)
    for key in ("name", "prompts"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise SuiteError(f"{where}.{key}: missing or not a string")
    prompts = raw["prompts"]
    if "{data_dir}" in prompts:
        if data_dir is None:
            raise SuiteError(f"{where}.prompts uses {{data_dir}}: set data_dir or --data-dir")
        prompts = prompts.replace("{data_dir}", str(data_dir))
    limit = raw.get("limit")
    if limit is not None:
        limit = _positive_int(limit, f"{where}.limit")
    select = raw.get("select", "first")
    if select not in SELECTIONS:
        raise SuiteError(f"{where}.select: one of {', '.join(SELECTIONS)}, got {select!r}")
    return Benchmark(raw["name"], prompts, limit, select)


def parse_suite(raw: Any, source: str, base_dir: Path, data_dir: str | Path | None = None) -> Suite:
    """A `Suite` from a parsed YAML mapping; `source` names it in errors. A relative
    `data_dir` in the file resolves against `base_dir` (the file's folder), one given as the
    `data_dir` argument against the working directory."""
    if not isinstance(raw, dict):
        raise SuiteError(f"{source}: a suite file is a YAML mapping")
    _known_keys(raw, _SUITE_KEYS, source)
    if data_dir is not None:  # from the command line: relative to where it was typed
        data = Path(data_dir).expanduser().resolve()
    elif raw.get("data_dir") is not None:  # in the file: relative to the file
        data = (base_dir / Path(str(raw["data_dir"])).expanduser()).resolve()
    else:
        data = None
    rollouts = raw.get("rollouts") or {}
    if not isinstance(rollouts, dict):
        raise SuiteError(f"{source}: rollouts: a mapping of rollout settings")
    _known_keys(rollouts, _ROLLOUT_KEYS, f"{source}: rollouts")
    settings = {"temperature": 0.0, "max_new_tokens": 128, **rollouts}
    batch_size = _positive_int(settings.pop("batch_size", 16), f"{source}: rollouts.batch_size")
    try:
        sampling = SamplingSettings.from_dict(settings)
    except (TypeError, ValueError) as exc:
        raise SuiteError(f"{source}: rollouts: {exc}") from None
    benches = raw.get("benchmarks")
    if not isinstance(benches, list) or not benches:
        raise SuiteError(f"{source}: benchmarks: a non-empty list")
    parsed = [_benchmark(b, f"{source}: benchmarks[{i}]", data) for i, b in enumerate(benches)]
    names = [b.name for b in parsed]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SuiteError(f"{source}: benchmarks: the name {dup!r} is used twice")
    baseline = raw.get("baseline", "ngram")
    if not isinstance(baseline, str):
        raise SuiteError(f"{source}: baseline: a drafter spec string")
    try:
        spec = DrafterSpec.parse(baseline)  # a suite file: where the text enters
    except DrafterSpecError as exc:
        raise SuiteError(f"{source}: baseline: {exc}") from None
    return Suite(str(raw.get("name") or Path(source).stem), parsed, sampling, batch_size, spec)


def load_suite(path: str | Path, data_dir: str | Path | None = None) -> Suite:
    """Read a suite YAML file (format: module docstring)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise SuiteError(f"{path}:{line} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_suite(raw, str(path), path.parent, data_dir)


def benchmark_arg(text: str) -> Benchmark:
    """`NAME=SPEC` from the command line (`--benchmark code=my/prompts.jsonl:prompt`)."""
    name, eq, spec = text.partition("=")
    if not eq or not name or not spec or not re.fullmatch(r"[\w.+-]+", name):
        raise SuiteError(f"--benchmark {text!r}: expected NAME=PROMPT_SPEC")
    return Benchmark(name, spec)


def with_benchmarks(
    suite: Suite, extra: list[Benchmark], limit: int | None, baseline: DrafterSpec | None
) -> Suite:
    """`suite` with `extra` benchmarks added, each capped at `limit` prompts, and `baseline`
    (when given) in place of its own: what `--benchmark`, `--limit`, `--baseline` change."""
    benches = [*suite.benchmarks, *extra]
    if limit is not None:
        benches = [replace(b, limit=min(b.limit or limit, limit)) for b in benches]
    return replace(suite, benchmarks=benches, baseline=baseline or suite.baseline)


def select_prompts(prompts: list[Any], limit: int | None, how: str) -> list[Any]:
    """The first `limit` prompts, or `limit` spread evenly over the set (MT-Bench is ordered by
    category, so its first 32 would be writing and role-play only)."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if how == "first":
        return list(prompts[:limit])
    n = len(prompts)
    return [prompts[(i * n) // limit] for i in range(limit)]


def benchmark_rollouts(
    target: Any,
    suite: Suite,
    root: str | Path | None = None,
    progress: bool = True,
    log: Any = print,
) -> dict[str, Path]:
    """Each benchmark's rollout set, generated (resumably) only when missing.

    A set lives under `root` (default: the user cache) in a directory keyed by the
    target's weights, the prompts chosen and the sampling settings. A new greedy set
    stores no log-probs (the suite scores it greedily only, and that skips the fp32 LM
    head on a CPU); an interrupted set resumes as it was started."""
    root = Path(root) if root is not None else cache_root() / "suites"
    fp = target_fingerprint(target)
    out = {}
    for bench in suite.benchmarks:
        prompts = select_prompts(load_prompts(bench.prompts), bench.limit, bench.select)
        key = {
            "target": fp,
            # what the prompts are, not where the file lies (a moved data dir keeps its cache)
            "prompts": stable_hash([[p.id, p.text, p.messages] for p in prompts]),
            "sampling": suite.sampling.to_dict(),
        }
        directory = root / f"{bench.name}-{stable_hash(key)[:12]}"
        manifest = read_manifest(directory) or {}
        if manifest.get("complete") and manifest.get("num_rollouts") == len(prompts):
            log(f"[suite] {bench.name}: {len(prompts)} rollouts (cached)")
        else:
            log(f"[suite] {bench.name}: generating rollouts for {len(prompts)} prompts")
            started = manifest.get("store_logprobs", True) if manifest else None
            store_logprobs = not suite.sampling.greedy if started is None else started
            generate_rollouts(
                target,
                prompts,
                directory,
                suite.sampling,
                batch_size=suite.batch_size,
                progress=progress,
                prompt_spec=bench.prompts,
                store_logprobs=store_logprobs,
            )
        out[bench.name] = directory
    return out


def with_baseline(suite: Suite, drafters: list[DrafterSpec]) -> list[DrafterSpec]:
    """The drafters with the suite's baseline first (added if absent, moved if given).

    A bare `ngram` baseline proposes as many tokens as the trained drafters do (their
    common K), so prompt lookup is never handicapped by a shorter block."""
    baseline = suite.baseline
    if baseline == DrafterSpec("ngram"):
        ckpts = [c for c in (checkpoint_of(d) for d in drafters) if c is not None]
        sizes = {int(read_config(c).get("block_size", 0)) for c in ckpts}
        if len(sizes) == 1 and min(sizes) > 1:
            baseline = DrafterSpec.lookup(sizes.pop() - 1)
    rest = [d for d in drafters if d not in (suite.baseline, baseline)]
    return [baseline, *rest]


def run_suite(
    target: Any,
    suite: Suite,
    drafters: list[DrafterSpec],
    rollouts_root: str | Path | None = None,
    cache_dir: str | Path | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    progress: bool = True,
    drafter_dtype: Any = None,
    log: Any = print,
    split: bool = False,
) -> dict[str, Any]:
    """Score every drafter (baseline first) on every benchmark; a JSON-ready result.

    Per benchmark: each drafter's exact offline MAL with CI, AR_k, and its paired gain over
    the baseline; on the mean over benchmarks: MAL, CI and gain (stratified bootstrap,
    `suite_statistics`); and every pair of the other drafters, per benchmark and on the mean.
    `split`: per benchmark also the round starts grouped by what the baseline gets accepted
    there, with the per-round oracle's MAL (`lookup_split`)."""
    specs = with_baseline(suite, drafters)
    names = drafter_names(specs)
    dirs = benchmark_rollouts(target, suite, rollouts_root, progress, log)
    per_bench, rounds, stats_rows = [], [], []
    for bench in suite.benchmarks:
        rollouts, scored = load_scored(
            target, specs, dirs[bench.name], cache_dir, progress, drafter_dtype=drafter_dtype
        )
        tokens = torch.tensor([float(a.shape[0]) for a in scored[0]], dtype=torch.float64)
        stats = [offline_stats(acc) for acc in scored]
        rounds.append(BenchmarkRounds(tokens, torch.stack([s.per_rollout_rounds for s in stats])))
        stats_rows.append(stats)
        per_bench.append(
            {
                "name": bench.name,
                "prompts": bench.prompts,
                "limit": bench.limit,
                "select": bench.select,
                "rollouts": str(dirs[bench.name]),
                "num_rollouts": len(rollouts),
                "tokens": int(tokens.sum()),
            }
        )
        if split and len(specs) > 1:
            per_bench[-1]["baseline_split"] = lookup_split(scored, names)
    st = suite_statistics(rounds, n_boot=n_boot, seed=seed)
    for b, bench in enumerate(per_bench):
        bench["drafters"] = []
        for d, (name, spec) in enumerate(zip(names, specs, strict=True)):
            s = stats_rows[b][d]
            row = {
                "name": name,
                "path": str(spec),
                "mal": st.mal[b][d],
                "mal_ci95": list(st.mal_ci95[b][d]),
                "expected_rounds": s.expected_rounds,
                "ar_k": s.ar_k,
                "t_ge_k": s.t_ge_k,
            }
            if d > 0:
                row["vs_baseline"] = _gain_json(st.gain(0, d, b))
            bench["drafters"].append(row)
    mean = []
    for d, name in enumerate(names):
        row = {"name": name, "mal": st.mean[d], "mal_ci95": list(st.mean_ci95[d])}
        if d > 0:
            row["vs_baseline"] = _gain_json(st.gain(0, d))
        mean.append(row)
    pairs = [
        {
            "a": names[a],
            "b": names[b],
            "benchmarks": {
                bench["name"]: _gain_json(st.gain(a, b, i)) for i, bench in enumerate(per_bench)
            },
            "mean": _gain_json(st.gain(a, b)),
        }
        for a, b in itertools.combinations(range(1, len(names)), 2)
    ]
    return {
        "suite": suite.name,
        "target": getattr(target, "name", ""),
        "baseline": names[0],
        "sampling": suite.sampling.to_dict(),
        "n_boot": n_boot,
        "seed": seed,
        "benchmarks": per_bench,
        "mean": mean,
        "pairs": pairs,
    }


def _gain_json(g: Any) -> dict[str, Any]:
    return {"rel_gain": g.rel, "rel_gain_ci95": list(g.rel_ci95)}
