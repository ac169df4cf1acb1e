"""`blockdraft demo`: the whole pipeline on one target, with sensible small defaults.

What a new user runs first, so it must finish on a laptop (the `tiny` target), show
progress throughout, and reuse every stage whose inputs did not change (`stages.py`).
Stages, each in its own directory under `out`: rollouts, drafters from scratch (decay,
D-PACE), the fine-tunes from D-PACE (E2E, EDR) and their control (`dpace-ft`), offline
evaluation and comparison, real decoding, and the report (docs/architecture.md).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.decoding.hf_generate import ar_vs_hf, has_hf_generate
from blockdraft.decoding.loop import decode
from blockdraft.devices import drafter_dtype, resolve_flags
from blockdraft.engines.interface import EngineError
from blockdraft.engines.registry import DEFAULT_ENGINE, get_engine
from blockdraft.evaluation.eval_compare import compare, evaluate, load_scored, write_json
from blockdraft.evaluation.lookup_split import lookup_split
from blockdraft.evaluation.offline import mal_ci
from blockdraft.evaluation.scoring import score_rollout_set
from blockdraft.heap import retain_freed_memory
from blockdraft.pipeline.report import terminal_summary, write_report
from blockdraft.pipeline.stages import Stage, fingerprint, portable, recorded_key
from blockdraft.sampling import MAX_NEW_TOKENS
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.serving.serve_check import serve_check
from blockdraft.targets.fingerprint import target_fingerprint
from blockdraft.targets.registry import load_target
from blockdraft.training import train
from blockdraft.training.config import config_from_dict


@dataclass
class DemoSettings:
    """Everything the demo depends on; changing a field redoes the stages that use it."""

    target: str = "tiny"
    out: str = "blockdraft-demo"
    # T=0: how speculative decoders are usually reported (DFlash, EAGLE), and where prompt
    # lookup is a real competitor (research/results.md has both temperatures)
    temperature: float = 0.0
    block_size: int = 8
    train_prompts: str = "stdlib:train"
    eval_prompts: str = "stdlib:eval"
    num_train_prompts: int = 384
    num_eval_prompts: int = 64
    max_new_tokens: int = MAX_NEW_TOKENS
    drafter_layers: int = 1
    # the drafters' reduced draft vocabulary (`drafter.draft_vocab_size`); None = auto
    # (`draft_vocab_for`)
    draft_vocab_size: int | None = None
    num_anchors: int = 64
    batch_size: int = 8
    # the recipe study of research/results.md ("Beating prompt lookup")
    epochs: float = 12.0
    lr: float = 3e-3
    finetune_epochs: float = 1.0
    finetune_lr: float = 3e-4
    online_prompts: int = 8
    online_max_new_tokens: int = 64
    seed: int = 0
    # every stage's models (blockdraft.devices): auto = the GPU in bf16 if any, else CPU fp32
    device: str = "auto"
    dtype: str = "auto"
    # a target without a mask token needs one (recorded with the rollouts, which the
    # trainings and scorings then use); None = the target's own
    mask_token: str | None = None
    extra_overrides: list[str] = field(default_factory=list)


# (name, objective overrides, starts from)
SCRATCH = [("decay", ["objective.name=decay"]), ("dpace", ["objective.name=dpace"])]
# Fine-tunes of the D-PACE drafter, one epoch each; `dpace-ft` is their control (the same
# steps of D-PACE): a fine-tune has paid off only if it beats its start and the control.
# At T = 0, E2E and EDR train the tempered relaxation A = softmax(z / 0.5)(x), the default
# objective.greedy_temperature (research/results.md, "EDR as in the paper").
# EDR drafts 32 of each rollout's round starts with gradient, as good as all of them at a
# fraction of the cost (research/results.md, "Cost of the fine-tune epoch").
CONTROL = "dpace-ft"
FINETUNE = [
    (CONTROL, ["objective.name=dpace"]),
    ("e2e", ["objective.name=e2e"]),
    ("edr", ["objective.name=edr", "objective.max_anchors=32"]),
]
COMPARISONS = [
    ("decay", "dpace"),
    ("dpace", CONTROL),
    ("dpace", "e2e"),
    ("dpace", "edr"),
    (CONTROL, "e2e"),
    (CONTROL, "edr"),
    ("e2e", "edr"),
    ("ngram", "dpace"),
    ("ngram", "edr"),
    ("suffix", "dpace"),
    ("suffix", "edr"),
]
BASELINE = "ngram"  # prompt lookup with K = block_size - 1: the free drafter to beat
REFERENCE = "suffix"  # suffix decoding with the same K: vLLM's other free drafter
TRAIN_THREADS = 1  # per training on a CPU: fixed, so the weights do not depend on the load


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def make_rollouts(target: Any, s: DemoSettings, out: Path) -> dict[str, Path]:
    """Train and held-out rollouts (resumable; skipped when already complete)."""
    sampling = SamplingSettings(
        temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=s.seed
    )
    dirs = {}
    for split, spec, limit in (
        ("train", s.train_prompts, s.num_train_prompts),
        ("eval", s.eval_prompts, s.num_eval_prompts),
    ):
        prompts = load_prompts(spec, limit=limit)
        stage = Stage(
            out / "rollouts" / split,
            {
                "target": target_fingerprint(target),
                "spec": spec,
                "limit": limit,
                "sampling": sampling.to_dict(),
                # the prompts themselves: a changed selection or source redoes the set
                "prompts": fingerprint({"prompts": [asdict(p) for p in prompts]}),
            },
        )
        if stage.is_done():
            _log(f"rollouts/{split}: reused ({stage.outputs().get('count')} rollouts)")
        else:
            _log(f"rollouts/{split}: generating responses to {limit} prompts from {spec}")
            rs = generate_rollouts(
                target,
                prompts,
                stage.directory / "set",
                sampling,
                batch_size=16,
                shard_size=64,
                prompt_spec=spec,
            )
            stage.finish({"count": len(rs)})
        dirs[split] = stage.directory / "set"
    return dirs


def draft_vocab_for(s: DemoSettings, target: Any, train_rollouts: Path) -> int | None:
    """The drafters' draft vocabulary size, or None for the target's whole vocabulary.

    Why: a drafter only gains by proposing tokens the target emits, and greedy text uses
    few of them; scoring only those concentrates the softmax on them (research/results.md,
    "A draft vocabulary for the demo"). Auto: the distinct response tokens rounded up to a
    power of two; sampled text reaches most of the vocabulary, and then it is all of it."""
    if s.draft_vocab_size is not None:
        return s.draft_vocab_size
    seen: set[int] = set()
    for r in RolloutSet.open(train_rollouts):
        seen.update(r.response_ids.tolist())
    size = 1 << max(0, len(seen) - 1).bit_length()
    return size if size < int(target.vocab_size) else None


def _train_config(
    s: DemoSettings,
    run_dir: Path,
    rollouts: dict[str, Path],
    overrides: list[str],
    finetune_from: Path | None,
    draft_vocab: int | None = None,
) -> Any:
    base = [
        f"run_dir={run_dir}",
        f"seed={s.seed}",
        f"num_anchors={s.num_anchors}",
        f"target.name={s.target}",
        f"device={s.device}",
        f"target.dtype={s.dtype}",
        f"data.train_rollouts={rollouts['train']}",
        f"data.eval_rollouts={rollouts['eval']}",
        f"drafter.num_layers={s.drafter_layers}",
        f"drafter.block_size={s.block_size}",
        f"optim.batch_size={s.batch_size}",
        "eval.every=50",
        "eval.max_rollouts=32",
        "checkpoint.save_every=100",
        "checkpoint.keep_last=1",
        "logging.every=5",
    ]
    if draft_vocab is not None:
        base.append(f"drafter.draft_vocab_size={draft_vocab}")
    if finetune_from is None:
        base += [f"optim.epochs={s.epochs}", f"optim.lr={s.lr}"]
    else:
        base += [
            f"drafter.init_from={finetune_from}",
            f"optim.epochs={s.finetune_epochs}",
            f"optim.lr={s.finetune_lr}",
            "optim.warmup_ratio=0.0",
            # constant, as in the study that chose these settings (research/results.md s. 6)
            "optim.schedule=constant",
        ]
    return config_from_dict({}, base + overrides + list(s.extra_overrides))


def train_drafters(
    target: Any,
    s: DemoSettings,
    out: Path,
    rollouts: dict[str, Path],
    draft_vocab: int | None = None,
) -> dict[str, Path]:
    """Train decay and D-PACE from scratch, then the fine-tunes of the D-PACE one (E2E, EDR
    and the continued-D-PACE control): each group's trainings side by side, every drafter
    scoring `draft_vocab` tokens (None: the whole vocabulary; `draft_vocab_for`)."""
    finals: dict[str, Path] = {}
    for group in ([(n, o, None) for n, o in SCRATCH], [(n, o, "dpace") for n, o in FINETUNE]):
        todo: list[tuple[Any, bool, Stage]] = []
        for name, overrides, start in group:
            start_ckpt = finals[start] if start else None
            cfg = _train_config(
                s, out / "runs" / name, rollouts, overrides, start_ckpt, draft_vocab
            )
            inputs = {
                "config": portable(cfg.to_dict(), out),
                "start": recorded_key(out / "runs" / start) if start else None,
                # the rollout stages' keys, so regenerated rollouts retrain every drafter
                "rollouts": {k: recorded_key(v.parent) for k, v in sorted(rollouts.items())},
            }
            stage = Stage(out / "runs" / name, inputs)
            finals[name] = stage.directory / "final"
            if stage.is_done():
                _log(f"train {name}: reused")
                continue
            _log(f"train {name} ({f'fine-tuning from {start}' if start else 'from scratch'})")
            todo.append((cfg, (stage.directory / "checkpoints").is_dir(), stage))
        stages = [stage for *_, stage in todo]
        run_trainings(
            target,
            [(cfg, resume) for cfg, resume, _ in todo],
            on_done=lambda i, stages=stages: stages[i].finish({}),
        )
    return finals


def run_trainings(target: Any, jobs: list[tuple[Any, bool]], on_done: Any) -> None:
    """Run independent trainings `(config, resume)`, calling `on_done(i)` as each ends.

    On a CPU every training uses TRAIN_THREADS threads, so its weights do not depend on
    how many cores were idle when it started (the thread count changes MKL's reductions),
    and as many run side by side, each in its own process, as there are cores. Elsewhere
    (a GPU) they run one after another in this process."""
    cpu = target.device.type == "cpu"
    workers = min(len(jobs), _usable_cores() // TRAIN_THREADS) if cpu else 1
    if workers <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(TRAIN_THREADS if cpu else threads)
        try:
            for i, (cfg, resume) in enumerate(jobs):
                train(cfg, target=target, resume=resume)
                on_done(i)
        finally:
            torch.set_num_threads(threads)
        return
    context = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {
            pool.submit(_train_in_process, cfg, resume, position): position
            for position, (cfg, resume) in enumerate(jobs)
        }
        try:
            for future in as_completed(futures):
                future.result()  # the worker's exception, re-raised here
                on_done(futures[future])
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _train_in_process(cfg: Any, resume: bool, position: int) -> str:
    """One training in a worker process (it loads the target named in `cfg` itself).

    A spawned worker starts with glibc's malloc defaults whatever its parent set, so it
    keeps freed memory itself (heap.py)."""
    retain_freed_memory()
    torch.set_num_threads(TRAIN_THREADS)
    return str(train(cfg, resume=resume, bar_position=position))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def evaluate_offline(
    target: Any,
    s: DemoSettings,
    finals: dict[str, DrafterSpec],
    rollouts: dict[str, Path],
    out: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Exact offline MAL/AR_k of each drafter and the paired comparisons, on eval rollouts."""
    names = list(finals)
    _log("offline evaluation on held-out rollouts")
    cache = out / "scores"
    paths = [finals[n] for n in names]
    cast = drafter_dtype(s.dtype, target.device)
    result = evaluate(target, paths, [rollouts["eval"]], cache_dir=cache, drafter_dtype=cast)
    spec = RolloutSet.open(rollouts["eval"]).manifest.get("prompts", {}).get("spec", "prompts")
    bench_name = f"held-out {spec}"
    result["benchmarks"][0]["name"] = bench_name
    for d, name in zip(result["benchmarks"][0]["drafters"], names, strict=True):
        d["name"] = name
    # where each drafter wins and loses against prompt lookup (first): from the cached scores
    _, scored = load_scored(target, paths, rollouts["eval"], cache, False, drafter_dtype=cast)
    result["benchmarks"][0]["baseline_split"] = lookup_split(scored, names)
    comparisons = []
    for a, b in COMPARISONS:
        pair = [finals[a], finals[b]]
        kw = {"cache_dir": cache, "progress": False, "drafter_dtype": cast}
        rows = compare(target, pair, [rollouts["eval"]], **kw)
        for row in rows:
            row["a"], row["b"], row["benchmark"] = a, b, bench_name
        comparisons.extend(rows)
    return result, comparisons


def _progress_line(p: Any) -> str:
    """One line per decoded prompt: the online stage is the demo's slowest to watch."""
    ar = f" (AR {p.ar_tokens_per_s:.0f})" if p.ar_tokens_per_s else ""
    return f"{p.done}/{p.total} prompts, {p.tokens_per_s:.0f} tok/s{ar}, tau {p.tau:.2f}"


def evaluate_online(
    target: Any,
    s: DemoSettings,
    finals: dict[str, DrafterSpec],
    rollouts: dict[str, Path],
    out: Path,
) -> dict[str, Any]:
    """Real speculative decoding of held-out prompts: tau, speedup vs our AR loop and vs
    HF generate, and each drafter's offline MAL on the same prompts at the same length
    (the first `online_prompts` eval rollouts cut to `online_max_new_tokens`), so online
    and offline measure the same text: at T = 0 they must be equal."""
    rs = RolloutSet.open(rollouts["eval"])
    same = rs.subset(range(min(s.online_prompts, len(rs))))
    prompts = [r.prompt_ids.tolist() for r in same]
    hf: dict[str, float] = {}
    if has_hf_generate(target):
        _log(f"online decoding: HF generate vs our AR loop ({len(prompts)} prompts)")
        hf = ar_vs_hf(target, prompts, s.temperature, s.online_max_new_tokens)
    online = {}
    for name, path in finals.items():
        if name == CONTROL:  # only compared offline: it is a yardstick, not a drafter to ship
            continue
        _log(f"online decoding with {name} ({len(prompts)} prompts)")
        cast = drafter_dtype(s.dtype, target.device)
        drafter, drafter_id = load_drafter_spec(path, target, dtype=cast)
        res = decode(
            target,
            drafter,
            prompts,
            temperature=s.temperature,
            max_new_tokens=s.online_max_new_tokens,
            seed=s.seed,
            callback=lambda p, name=name: _log(f"  {name}: {_progress_line(p)}"),
        )
        acc = score_rollout_set(
            drafter, target, same, drafter_id=drafter_id, cache_dir=out / "scores"
        )
        mal, ci = mal_ci([a[: s.online_max_new_tokens - 1] for a in acc])
        vs_hf = res.speedup * hf["ar_vs_hf"] if hf and res.speedup else None
        online[name] = {
            "tau": res.tau,
            "tau_ci95": list(res.tau_ci95),
            "histogram": res.histogram,
            "tokens_per_s": res.tokens_per_s,
            "ar_tokens_per_s": res.ar_tokens_per_s,
            "speedup": res.speedup,
            "speedup_ci95": None if res.speedup_ci95 is None else list(res.speedup_ci95),
            "speedup_vs_hf": vs_hf,
            "hf_tokens_per_s": hf.get("hf_tokens_per_s"),
            "offline_mal": mal,
            "offline_mal_ci95": list(ci),
            "other_load_cores": max(
                res.other_load_cores or 0.0, hf.get("ar_vs_hf_other_load_cores") or 0.0
            ),
            "machine_busy": res.machine_busy or bool(hf.get("ar_vs_hf_busy")),
        }
    return online


SERVED_DRAFTER = "edr"


def served_in_vllm(
    target: Any, s: DemoSettings, trained: dict[str, Path], rollouts: dict[str, Path], out: Path
) -> dict[str, Any] | None:
    """With vLLM installed (`make engine`), the EDR drafter served by vLLM on the online
    prompts next to vLLM's prompt lookup and no speculation (`serve_check`); None without
    vLLM or when vLLM cannot serve it (said in one line: the demo's results stand)."""
    version = get_engine(DEFAULT_ENGINE).version()
    if version is None or SERVED_DRAFTER not in trained or s.temperature != 0:
        return None
    stage = Stage(
        out / "served",
        {
            "drafter": recorded_key(trained[SERVED_DRAFTER].parent),
            "settings": fingerprint(portable(_settings_key(s, out), out)),
            "engine": version,
            "version": 1,
        },
    )
    if stage.is_done():
        _log("vLLM: reused")
        return stage.outputs()["served"]
    _log(f"vLLM: serving {SERVED_DRAFTER} on {s.online_prompts} held-out prompts")
    try:
        result = serve_check(
            target,
            trained[SERVED_DRAFTER],
            [rollouts["eval"]],
            limit=s.online_prompts,
            batch_size=s.online_prompts,
            log=lambda msg: None,
        )
    except EngineError as exc:
        _log(f"vLLM: not served ({exc})")
        return None
    bench = result["benchmarks"][0]
    way = bench["served"]
    b = f"tokens_per_s_batch{s.online_prompts}"
    served = {
        "engine": result["engine"],
        "drafter": SERVED_DRAFTER,
        "num_prompts": bench["num_prompts"],
        "outputs_equal_rollouts": way["dflash"]["outputs_equal_rollouts"],
        "rounds_equal_offline": bench["agreement"]["dflash"]["exact"],
        "served_tau": way["dflash"]["served_tau"],
        "offline_mal": bench["offline"]["dflash"]["mal"],
        "vllm_ngram_served_tau": way["ngram"]["served_tau"],
        "tokens_per_s": {
            w: {"batch1": v["tokens_per_s_batch1"], f"batch{s.online_prompts}": v[b]}
            for w, v in way.items()
        },
    }
    stage.finish({"served": served})
    return served


def served_summary(served: dict[str, Any]) -> str:
    """The vLLM row of the demo's summary."""
    tps = served["tokens_per_s"]
    batches = list(next(iter(tps.values())))
    speeds = "; ".join(
        f"{batch}: " + ", ".join(f"{w} {v[batch]:.0f}" for w, v in tps.items()) for batch in batches
    )
    return (
        f"Served by {served['engine']} ({served['drafter']}, {served['num_prompts']} prompts): "
        f"outputs equal the rollouts {served['outputs_equal_rollouts']}/{served['num_prompts']}, "
        f"rounds {'equal' if served['rounds_equal_offline'] else 'NOT equal'} to the offline "
        f"evaluator's, served tau {served['served_tau']:.3f} (offline MAL "
        f"{served['offline_mal']:.3f}; vLLM's prompt lookup {served['vllm_ngram_served_tau']:.3f})"
        f"; tokens/s {speeds}"
    )


COMPARISON_KEYS = ("a", "b", "mal_gain", "mal_gain_ci95", "rel_gain", "rel_gain_ci95")


def build_report_json(
    s: DemoSettings,
    rollouts: dict[str, Path],
    offline: dict[str, Any],
    comparisons: list[dict[str, Any]],
    online: dict[str, Any],
) -> dict[str, Any]:
    """The machine-readable summary other tools read (`DIR/report.json`), in the keys of
    the commands' JSON: `mal` as `eval`, `tau` and `offline_mal` as `decode`, `mal_gain`
    and `rel_gain` as `compare` (tests/test_api.py compares the key sets)."""
    objective = {n: n for n, _ in SCRATCH + FINETUNE}
    objective |= {BASELINE: "none", REFERENCE: "none", CONTROL: "dpace"}
    drafters = []
    for d in offline["benchmarks"][0]["drafters"]:
        o = online.get(d["name"], {})
        drafters.append(
            {
                "name": d["name"],
                "objective": objective.get(d["name"], d["name"]),
                "mal": d["mal"],
                "mal_ci95": d["mal_ci95"],
                "tau": o.get("tau"),
                "tau_ci95": o.get("tau_ci95"),
                "speedup": o.get("speedup"),
                "speedup_ci95": o.get("speedup_ci95"),
                "speedup_vs_hf": o.get("speedup_vs_hf"),
                "machine_busy": o.get("machine_busy", False),
                "other_load_cores": o.get("other_load_cores"),
                # the offline MAL of the online prompts at the online length (= tau at T = 0)
                "offline_mal": o.get("offline_mal"),
                "ar_k": d["ar_k"],
            }
        )
    return {
        "target": s.target,
        "block_size": s.block_size,
        "temperature": s.temperature,
        "rollouts": {k: len(RolloutSet.open(v)) for k, v in rollouts.items()},
        "drafters": drafters,
        "comparisons": [{k: c[k] for k in COMPARISON_KEYS} for c in comparisons],
        "settings": asdict(s),
    }


def _settings_key(s: DemoSettings, out: Path) -> dict[str, Any]:
    """The settings a stage key hashes: `device`/`dtype` only when not `auto`, so demo
    directories made before they existed keep their cached stages."""
    d = {**asdict(s), "out": str(out)}
    for name in ("device", "dtype"):
        if d[name] == "auto":
            del d[name]
    if d["mask_token"] is None:
        del d["mask_token"]
    return d


def run_demo(s: DemoSettings) -> dict[str, Any]:
    """Run (or resume) every stage; write report.md, PNGs and report.json; return the JSON."""
    out = Path(s.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = resolve_flags(s.device, s.dtype)
    where = f"{device}, {str(dtype).removeprefix('torch.')}"
    _log(f"target {s.target!r} on {where}")
    target = load_target(s.target, device=device, dtype=dtype, mask_token=s.mask_token)
    rollouts = make_rollouts(target, s, out)
    draft_vocab = draft_vocab_for(s, target, rollouts["train"])
    trained = train_drafters(target, s, out, rollouts, draft_vocab)
    checkpoints = {n: DrafterSpec(path=str(p)) for n, p in trained.items()}
    k = s.block_size - 1
    finals = {BASELINE: DrafterSpec.lookup(k), REFERENCE: DrafterSpec.suffix(k), **checkpoints}
    offline, comparisons = evaluate_offline(target, s, finals, rollouts, out)
    online_stage = Stage(
        out / "online",
        {
            "drafters": {n: recorded_key(p.parent) for n, p in trained.items() if n != CONTROL},
            "settings": fingerprint(portable(_settings_key(s, out), out)),
            "version": 6,  # raised when what the stage computes changes
        },
    )
    if online_stage.is_done():
        _log("online decoding: reused")
        online = online_stage.outputs()["online"]
    else:
        online = evaluate_online(target, s, finals, rollouts, out)
        online_stage.finish({"online": online})
    drafters = [
        {**d, "benchmark": offline["benchmarks"][0]["name"]}
        for d in offline["benchmarks"][0]["drafters"]
    ]
    logs = {n: p.parent / "metrics.jsonl" for n, p in trained.items()}
    split = offline["benchmarks"][0]["baseline_split"]
    md = write_report(
        out / "report",
        drafters,
        comparisons,
        logs,
        online,
        title=f"blockdraft demo on {s.target}",
        baseline_split=(BASELINE, split),
    )
    report = build_report_json(s, rollouts, offline, comparisons, online)
    report["draft_vocab_size"] = draft_vocab
    report["baseline_split"] = split
    served = served_in_vllm(target, s, trained, rollouts, out)
    if served is not None:
        report["served_vllm"] = served
    write_json(out / "report.json", report)
    print(terminal_summary(report), flush=True)
    if served is not None:
        print(served_summary(served), flush=True)
    _log(f"report: {md}  json: {out / 'report.json'}")
    return report
