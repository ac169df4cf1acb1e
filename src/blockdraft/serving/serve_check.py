"""`serve_check`: run an exported drafter in a serving engine on a rollout set's prompts.

Why: the offline evaluator's MAL is only a promise about serving. This runs an engine
(`engines/`, vLLM by default) on the same prompts and settings three ways (the drafter,
the engine's `ngram` prompt lookup, no speculation; `suffix`, suffix decoding, on request)
and sets its counters beside the offline numbers: at T = 0 the outputs must equal the
rollouts and the rounds per request the evaluator's exact rounds (so the served tau equals
the offline MAL; the engine's own mean acceptance length also counts tokens accepted past
an output's end, reported apart), accepted tokens by position beside T_{>=k},
and tokens/s at batch 1 and batched. At T > 0 the served tau is checked against the
offline MAL's bootstrap CI. The drafter may be a `lookup_inputs` one, a
`hybrid[:conf=C]:PATH` or a `trim[:conf=C]:PATH` spec: exported lookup-aware, served
through blockdraft's vLLM plugin, and held to the same checks. Definitions: docs/serving.md.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockdraft.data.rollouts.engine import row_seed
from blockdraft.data.rollouts.store import RolloutSet, check_target
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.drafters.suffix import SuffixConfig
from blockdraft.engines.interface import EngineError, RunningEngine, SpecCounters, Speculation
from blockdraft.engines.registry import DEFAULT_ENGINE, get_engine
from blockdraft.evaluation.eval_compare import benchmark_name
from blockdraft.evaluation.offline import mal_ci, offline_stats
from blockdraft.evaluation.scoring import score_rollout_set, shared_target_features
from blockdraft.serialization.drafter_spec import DrafterSpec, checkpoint_of, load_drafter_spec
from blockdraft.serialization.export import export_config, export_drafter
from blockdraft.targets.registry import model_directory

WAYS = ("dflash", "ngram", "suffix", "none")
DEFAULT_WAYS = ("dflash", "ngram", "none")  # suffix needs arctic-inference beside vLLM
NGRAM = NgramDrafter()  # blockdraft's prompt lookup; the engine's `ngram` is set to the same rule
LOOKUP_WAYS = ("ngram", "suffix")  # free drafters: the engine's drafting steps give their rounds


@dataclass
class Benchmark:
    """One rollout set to check: its name, rows and what the evaluator says about them."""

    name: str
    directory: str
    rollouts: RolloutSet
    offline: dict[str, Any] = field(default_factory=dict)


@dataclass
class WayRun:
    """What one way of serving did on one benchmark."""

    outputs: list[list[int]]
    per_request: list[SpecCounters]
    seconds_batch1: float
    tokens_batch1: int
    seconds_batched: float
    tokens_batched: int
    equal_batched: int
    lookup_steps: list[int] | None = None  # prompt lookup's drafting steps per request


def speculation(
    way: str, export_dir: str | None, num_proposals: int, sampled: bool = False
) -> Speculation | None:
    """How the engine drafts in a way of serving (None: no speculation). At T > 0 the
    drafter's tokens are sampled and verified with min(1, p/q) (`sampled`): the
    speculative sampling the evaluator scores and EDR trains for."""
    if way == "none":
        return None
    if way == "ngram":
        c = NGRAM.config
        return Speculation("ngram", num_proposals, lookup_min=c.min_ngram, lookup_max=c.max_ngram)
    if way == "suffix":  # blockdraft's `suffix:k=K`: the request's own tree, no global one
        return Speculation("suffix", num_proposals, suffix=SuffixConfig())
    return Speculation("dflash", num_proposals, model=export_dir, sampled=sampled)


def _offline(
    target: Any,
    rollouts: RolloutSet,
    drafter_spec: DrafterSpec,
    n_boot: int,
    suffix: DrafterSpec | None = None,
) -> dict[str, Any]:
    """The evaluator's numbers for the drafter, prompt lookup and (given) suffix decoding
    on these rows."""
    out = {}
    specs = [("dflash", drafter_spec), ("ngram", DrafterSpec("ngram"))]
    with shared_target_features():
        for name, spec in specs + ([("suffix", suffix)] if suffix is not None else []):
            drafter, drafter_id = load_drafter_spec(spec, target)
            acc = score_rollout_set(
                drafter, target, rollouts, drafter_id=drafter_id, progress=False
            )
            stats = offline_stats(acc)
            _, ci = mal_ci(acc, n_boot=n_boot)
            out[name] = {
                "mal": stats.mal,
                "mal_ci95": list(ci),
                "expected_rounds": stats.expected_rounds,
                "per_rollout_rounds": [float(r) for r in stats.per_rollout_rounds],
                "ar_k": stats.ar_k,
                "t_ge_k": stats.t_ge_k,
                "tokens": stats.tokens,
            }
    return out


def _served_drafter(
    drafter: str | Path | DrafterSpec,
) -> tuple[DrafterSpec, Path, dict[str, float | None], dict[str, Any]]:
    """(the spec scored, its checkpoint, the export's `hybrid_conf` and `trim_conf`, the
    config.json its export will have): a path names a checkpoint, run or export; a
    `DrafterSpec` may also be `hybrid[:conf=C]:PATH` (served with its lookup fallback) or
    `trim[:conf=C]:PATH` (its confident prefix), both by blockdraft's vLLM plugin."""
    spec = drafter if isinstance(drafter, DrafterSpec) else DrafterSpec(path=str(drafter))
    if spec.kind == "ngram":
        raise EngineError("serve-check serves a trained drafter; prompt lookup is its `ngram` way")
    ckpt = checkpoint_of(spec)
    assert ckpt is not None
    confs = {
        "hybrid_conf": spec.min_confidence if spec.kind == "hybrid" else None,
        "trim_conf": spec.min_confidence if spec.kind == "trim" else None,
    }
    cfg = export_config(ckpt, **confs)
    return DrafterSpec(spec.kind, str(ckpt), spec.options), ckpt, confs, cfg


def _run_way(
    engine: RunningEngine, bench: Benchmark, stop_ids: list[int], batch: int, recording: bool
) -> WayRun:
    """Batch 1 (one request at a time, counters read between requests), then batched.

    `recording`: the engine records its drafting steps (prompt lookup's): each request's
    count, read at batch 1, gives its rounds exactly, steps without a match included."""
    settings = bench.rollouts.settings
    rows = list(bench.rollouts)
    seeds = [row_seed(settings.seed, r.prompt_id) for r in rows]
    prompts = [r.prompt_ids.tolist() for r in rows]
    outputs, per_request, steps = [], [], []
    started = time.perf_counter()
    for prompt, seed in zip(prompts, seeds, strict=True):
        before = engine.counters()
        outputs.append(engine.generate([prompt], settings, stop_ids, [seed])[0].response_ids)
        per_request.append(engine.counters().minus(before))
        if recording:
            steps.append(len(engine.take_drafts()))
    seconds1 = time.perf_counter() - started
    batched_tokens, equal = 0, 0
    started = time.perf_counter()
    for a in range(0, len(prompts), batch):
        batch_rows = engine.generate(
            prompts[a : a + batch], settings, stop_ids, seeds[a : a + batch]
        )
        for i, row in enumerate(batch_rows):
            batched_tokens += len(row.response_ids)
            equal += row.response_ids == outputs[a + i]
    seconds_b = time.perf_counter() - started
    if recording:
        engine.take_drafts()  # the batched steps: not per request
    return WayRun(
        outputs,
        per_request,
        seconds1,
        sum(len(o) for o in outputs),
        seconds_b,
        batched_tokens,
        equal,
        steps if recording else None,
    )


def _way_report(run: WayRun, bench: Benchmark, way: str, batch_size: int) -> dict[str, Any]:
    """One way's numbers: lossless count, rounds, tau and per-position counts, speed."""
    rows = list(bench.rollouts)
    greedy = bench.rollouts.settings.greedy
    equal = [o == r.response_ids.tolist() for o, r in zip(run.outputs, rows, strict=True)]
    total = SpecCounters()
    for c in run.per_request:
        total = SpecCounters(
            total.drafts + c.drafts,
            total.draft_tokens + c.draft_tokens,
            total.accepted + c.accepted,
            [
                a + b
                for a, b in zip(
                    total.accepted_per_position or [0] * len(c.accepted_per_position),
                    c.accepted_per_position,
                    strict=False,
                )
            ],
        )
    tokens_after_first = sum(max(len(o) - 1, 0) for o in run.outputs)
    report: dict[str, Any] = {
        "outputs_equal_rollouts": sum(equal) if greedy else None,
        "num_prompts": len(rows),
        "tokens_per_s_batch1": run.tokens_batch1 / run.seconds_batch1,
        f"tokens_per_s_batch{batch_size}": run.tokens_batched / run.seconds_batched,
        "batched_outputs_equal_batch1": run.equal_batched,
    }
    if way == "none":
        return report
    # tokens a round yielded = 1 + accepted; rounds = decoding steps after the first token
    if run.lookup_steps is not None:  # ngram, suffix, a trimmed drafter: every drafting
        # step recorded, [] or not; the last one, after the final round, is never verified
        rounds = [max(n - 1, 0) for n in run.lookup_steps]
    elif way == "dflash":  # the drafter proposes in every step: rounds = drafts, exactly, except
        # in an engine that drafts no further than the response (llama.cpp): its last step,
        # with one token left, drafts nothing, and steps = tokens after the first - accepted
        rounds = [
            max(c.drafts, max(len(o) - 1, 0) - c.accepted)
            for c, o in zip(run.per_request, run.outputs, strict=True)
        ]
    else:  # from the counters: steps without a match draft nothing, and engines count tokens
        # it accepted past a response's end, so this undercounts rounds by a few
        rounds = [
            max(c.drafts, max(len(o) - 1, 0) - c.accepted)
            for c, o in zip(run.per_request, run.outputs, strict=True)
        ]
    report.update(
        {
            "drafts": total.drafts,
            "accepted": total.accepted,
            "accepted_per_position": total.accepted_per_position,
            "rounds": sum(rounds),
            "per_request_rounds": rounds,
            "engine_mean_acceptance_length": total.mean_acceptance_length,
            "served_tau": tokens_after_first / sum(rounds) if sum(rounds) else math.nan,
            "outputs_equal": equal,
        }
    )
    return report


def _agreement(bench: Benchmark, served: dict[str, Any], way: str) -> dict[str, Any]:
    """How the served numbers sit against the evaluator's for the same way."""
    offline = bench.offline[way]
    greedy = bench.rollouts.settings.greedy
    out: dict[str, Any] = {"offline_mal": offline["mal"], "served_tau": served["served_tau"]}
    if greedy:
        same = [i for i, e in enumerate(served["outputs_equal"]) if e]
        mismatched = [
            i
            for i in same
            if served["per_request_rounds"][i] != round(offline["per_rollout_rounds"][i])
        ]
        out["rounds_compared_on"] = len(same)
        out["rounds_differ_on"] = mismatched
        out["exact"] = not mismatched and len(same) == len(served["outputs_equal"])
        if way == "dflash" and len(same) == len(served["outputs_equal"]):  # the same text
            per = [
                v - o
                for v, o in zip(served["accepted_per_position"], offline["t_ge_k"], strict=False)
            ]
            # the engine counts what it accepted in a response's last round even where the
            # response ended (max_tokens or a stop token) before those tokens
            out["accepted_past_end_per_position"] = [round(x, 6) for x in per]
            out["accepted_past_end"] = round(sum(per), 6)
    else:
        lo, hi = offline["mal_ci95"]
        out["inside_offline_ci95"] = lo <= served["served_tau"] <= hi
    return out


def serve_check(
    target: Any,
    drafter: str | Path | DrafterSpec,
    rollout_dirs: Sequence[str | Path],
    *,
    ways: Sequence[str] = DEFAULT_WAYS,
    limit: int | None = None,
    batch_size: int = 8,
    dtype: str | None = None,
    n_boot: int = 2000,
    log: Any = print,
    engine: str = DEFAULT_ENGINE,
) -> dict[str, Any]:
    """Serve `drafter` in `engine` on each rollout set's prompts; the JSON-ready comparison."""
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        raise EngineError(f"unknown way {unknown[0]!r}: choose from {', '.join(WAYS)}")
    kind = get_engine(engine)
    model_dir = model_directory(target)
    if model_dir is None:
        raise EngineError(f"target {target.name!r} has no local model folder for {engine} to load")
    spec, ckpt, confs, cfg = _served_drafter(drafter)
    problem = kind.serve_problem(cfg, target.model.config)
    if problem and "dflash" in ways:
        raise EngineError(problem)
    num_proposals = int(cfg.get("block_size") or cfg["dflash_config"]["block_size"]) - 1
    benches = []
    for directory in rollout_dirs:
        rollouts = RolloutSet.open(directory)
        check_target(rollouts, target)
        if limit is not None:
            rollouts = rollouts.subset(range(min(limit, len(rollouts))))
        bench = Benchmark(benchmark_name(rollouts, directory), str(directory), rollouts)
        log(f"[serve-check] {bench.name}: offline scores of {len(rollouts)} rollouts")
        suffix = DrafterSpec.suffix(num_proposals) if "suffix" in ways else None
        bench.offline = _offline(target, rollouts, spec, n_boot, suffix)
        benches.append(bench)
    dtype = dtype or str(target.dtype).removeprefix("torch.")
    results: dict[str, dict[str, Any]] = {b.name: {} for b in benches}
    engine_version = None
    with tempfile.TemporaryDirectory(prefix="blockdraft-serve-") as tmp:
        export_dir = None
        if "dflash" in ways:
            export_dir = str(export_drafter(ckpt, Path(tmp) / "drafter", target=target, **confs))
        for way in ways:
            log(
                f"[serve-check] {engine} ({way}): {len(benches)} benchmark(s), batch 1 and "
                f"{batch_size}"
            )
            sampled = any(not b.rollouts.settings.greedy for b in benches)
            # every drafting step, empty ones included, where a way may propose nothing
            trimmed = way == "dflash" and confs["trim_conf"] is not None
            recording = (way in LOOKUP_WAYS or trimmed) and kind.records_lookup_steps
            with kind.load(
                model_dir,
                dtype=dtype,
                speculation=speculation(way, export_dir, num_proposals, sampled),
                max_model_len=target.context_length or 4096,
                record_drafts=recording,
            ) as running:
                engine_version = f"{engine} {running.version}"
                for bench in benches:
                    run = _run_way(
                        running, bench, list(target.stop_token_ids), batch_size, recording
                    )
                    results[bench.name][way] = _way_report(run, bench, way, batch_size)
    out: dict[str, Any] = {
        "target": target.name,
        "drafter": str(spec) if spec.kind in ("hybrid", "trim") else str(ckpt),
        "engine": engine_version,
        "batch_size": batch_size,
        "benchmarks": [],
    }
    for bench in benches:
        served = results[bench.name]
        entry: dict[str, Any] = {
            "name": bench.name,
            "rollouts": bench.directory,
            "settings": bench.rollouts.settings.to_dict(),
            "num_prompts": len(bench.rollouts),
            "offline": bench.offline,
            "served": served,
            "agreement": {
                way: _agreement(bench, served[way], way)
                for way in ("dflash", *LOOKUP_WAYS)
                if way in served and (way == "dflash" or kind.lookup_rules_match)
            },
            # the engine's own lookup rules: their rounds are reported, never compared
            "engine_rules": [w for w in LOOKUP_WAYS if w in served and not kind.lookup_rules_match],
        }
        out["benchmarks"].append(entry)
    return out


def _leading_ones(row: Any) -> int:
    n = 0
    for v in row:
        if float(v) < 0.5:
            break
        n += 1
    return n


def rounds_trace(
    target: Any,
    drafter: str | Path | DrafterSpec,
    rollout_dir: str | Path,
    index: int,
    engine: str = DEFAULT_ENGINE,
) -> dict[str, Any]:
    """One greedy prompt served by `engine` with the drafter, round by round: each round's
    anchor, the engine's proposals, the rollout's next tokens, and how many tokens it
    accepted next to how many the evaluator's acceptance row for that position accepts.
    The first round where they differ is where a served/offline gap comes from."""
    rollouts = RolloutSet.open(rollout_dir)
    check_target(rollouts, target)
    if not rollouts.settings.greedy:
        raise EngineError("--rounds compares rounds of a greedy (temperature 0) rollout set")
    if not 0 <= index < len(rollouts):
        raise EngineError(f"--rounds {index}: {rollout_dir} holds prompts 0..{len(rollouts) - 1}")
    one = rollouts.subset([index])
    row = one[0]
    spec, ckpt, confs, cfg = _served_drafter(drafter)
    kind = get_engine(engine)
    problem = kind.serve_problem(cfg, target.model.config)
    if problem:
        raise EngineError(problem)
    model, model_id = load_drafter_spec(spec, target)
    acc = score_rollout_set(model, target, one, drafter_id=model_id, progress=False)[0]
    k = int(model.config.num_proposals)
    with tempfile.TemporaryDirectory(prefix="blockdraft-rounds-") as tmp:
        export_dir = str(export_drafter(ckpt, Path(tmp) / "drafter", target=target, **confs))
        with kind.load(
            model_directory(target),
            dtype=str(target.dtype).removeprefix("torch."),
            speculation=speculation("dflash", export_dir, k),
            max_model_len=target.context_length or 4096,
            record_drafts=True,
        ) as running:
            stop_ids = list(target.stop_token_ids)
            prompt = row.prompt_ids.tolist()
            output = running.generate([prompt], rollouts.settings, stop_ids, [None])[0]
            steps = running.take_drafts()
    tokens = row.response_ids.tolist()
    rounds, start = [], 0
    for anchors, proposals in steps:
        if start >= len(tokens) - 1:
            break
        proposed = proposals[0]
        actual = tokens[start + 1 : start + 1 + k]
        served = 0
        while served < len(actual) and proposed[served] == actual[served]:
            served += 1
        offline = min(_leading_ones(acc[start]), len(actual))
        rounds.append(
            {
                "start": start,
                "anchor": anchors[0] if anchors else None,
                "anchor_is_rollout_token": bool(anchors) and anchors[0] == tokens[start],
                "proposed": proposed,
                "rollout_next": actual,
                "served_accepted": served,
                "offline_accepted": offline,
            }
        )
        start += served + 1
    first = next(
        (i for i, r in enumerate(rounds) if r["served_accepted"] != r["offline_accepted"]), None
    )
    return {
        "prompt": row.prompt_id,
        "output_equals_rollout": output.response_ids == tokens,
        "rounds": rounds,
        "first_difference": first,
    }


__all__ = ["DEFAULT_WAYS", "WAYS", "rounds_trace", "serve_check", "speculation"]
