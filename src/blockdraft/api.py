"""The Python API: every stage of the `blockdraft` command as one function.

Why a facade: the library functions take what the command line has already parsed
(devices, dtypes, settings, prompt lists, recorded mask tokens); these take names, paths
and plain numbers and parse them as the command does. Each result is the document the
matching command writes with `--json` (`blockdraft.evaluate(...)` is `blockdraft eval
--json`). Page: docs/python-api.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from blockdraft import API
from blockdraft.data.mask_records import recorded_masks
from blockdraft.data.prompt_specs import load_prompts, render_prompt
from blockdraft.data.prompt_type import Prompt
from blockdraft.data.rollouts import generate_rollouts as _generate_rollouts
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.decoding.loop import decode as _decode
from blockdraft.devices import drafter_dtype, resolve_flags
from blockdraft.errors import BlockdraftError
from blockdraft.evaluation import eval_compare
from blockdraft.evaluation.suite import Suite, benchmark_arg, load_suite, with_benchmarks
from blockdraft.evaluation.suite import run_suite as _run_suite
from blockdraft.recipes import TRAIN, resolve_recipe
from blockdraft.sampling import MAX_NEW_TOKENS, SamplingSettings
from blockdraft.serialization.checkpoint import resolve_checkpoint
from blockdraft.serialization.drafter_spec import DrafterSpec, checkpoint_of, load_drafter_spec
from blockdraft.serialization.export import export_drafter
from blockdraft.targets.mask_token import load_target_with_mask
from blockdraft.targets.target import Target
from blockdraft.training.config import TrainConfig, config_from_dict, load_config
from blockdraft.training.trainer import train as _train

__all__ = list(API)  # one list: `blockdraft/__init__.py` loads these names lazily

Paths = str | Path | Iterable[str | Path]


class APIError(BlockdraftError, ValueError):
    """A wrong-typed or out-of-range argument of a `blockdraft.*` function (one line
    naming the argument, as the command's `error:` line names the flag)."""


def _many(value: Paths, name: str = "paths") -> list[str]:
    """One path or spec, or several, as a list of strings (a RolloutSet by its directory)."""
    if isinstance(value, (str, Path, RolloutSet, DrafterSpec)):
        value = [value]
    elif not isinstance(value, Iterable):
        raise APIError(f"{name}: expected a path or a list of paths, got {value!r:.60}")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, (str, Path, RolloutSet, DrafterSpec)):
            raise APIError(f"{name}[{i}]: expected a path or name (str), got {v!r:.60}")
        out.append(str(v.directory if isinstance(v, RolloutSet) else v))
    return out


def _target(target: Any, where: str) -> Target:
    """`target` must be a loaded `Target`: a name (`"tiny"`) is one line saying how."""
    if not isinstance(target, Target):
        hint = (
            f": load it first, target = blockdraft.load_target({target!r})"
            if isinstance(target, (str, Path))
            else ""
        )
        raise APIError(f"{where}: target must be a Target, got {target!r:.60}{hint}")
    return target


_RANGES: dict[str, tuple[type, float, float | None]] = {
    # name: (int or float, lowest, highest) as the command's flag checks them
    "n_boot": (int, 1, None),
    "seed": (int, 0, None),
    "temperature": (float, 0.0, None),
    "top_p": (float, 1e-12, 1.0),
    "top_k": (int, 0, None),
    "max_new_tokens": (int, 1, None),
    "limit": (int, 1, None),
    "batch_size": (int, 1, None),
    "shard_size": (int, 1, None),
    "store_topk": (int, 0, None),
}


def _check_numbers(where: str, **values: Any) -> None:
    """Each value a number of its kind in its range (`limit` may be None), else one line
    naming the argument: a string `"100"` or a float seed would fail deep in torch."""
    for name, value in values.items():
        if value is None and name == "limit":
            continue
        kind, low, high = _RANGES[name]
        number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if (
            not number
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value < low
            or (high is not None and value > high)
        ):
            what = "an integer" if kind is int else "a number"
            rule = f"in ({0:g}, {high:g}]" if name == "top_p" else f">= {low:g}"
            raise APIError(f"{where}: {name} must be {what} {rule}, got {value!r:.40}")


def _specs(value: Paths | DrafterSpec, *, check: bool = False) -> list[DrafterSpec]:
    """Drafters as the caller names them, parsed here, where the text enters; `check`: a
    missing checkpoint is one error before any scoring or rollout."""
    specs = [DrafterSpec.parse(v) for v in _many(value, "drafters")]
    if check:
        for d in specs:
            checkpoint_of(d)
    return specs


def load_target(
    name: str = "tiny",
    *,
    device: str = "auto",
    dtype: str = "auto",
    mask_token: str | int | None = None,
    rollouts: Paths = (),
    drafters: Paths = (),
    allow_download: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Target:
    """The target model by registry name (`tiny`, `gemma-3-270m`, `smollm2-135m`), Hugging
    Face id or local path, as every command's `--target` loads it.

    `device`/`dtype` take the commands' values (`auto`: the GPU in bfloat16 if there is
    one, else the CPU in float32). A target without a mask token needs `mask_token` once;
    later calls find it in the `rollouts` and `drafters` they name.

        >>> target = blockdraft.load_target("tiny", device="cpu")
    """
    dev, dt = resolve_flags(device, dtype)
    return load_target_with_mask(
        name,
        mask_token=mask_token,
        recorded=recorded_masks(_many(rollouts, "rollouts"), _specs(drafters)),
        allow_download=allow_download,
        trust_remote_code=trust_remote_code,
        device=dev,
        dtype=dt,
        progress=progress,
    )


def _prompt_list(
    prompts: str | Sequence[str | Prompt], limit: int | None, allow_download: bool = False
) -> list[Prompt]:
    """A prompt spec (`examples/prompts.jsonl`, `stdlib:eval`), or the prompts themselves
    (plain strings get ids `p0`, `p1`, ...: a rollout's seed derives from its id); any
    other item (a number, a token-id list) is refused, never turned into its repr."""
    if isinstance(prompts, (str, Path)):
        return load_prompts(str(prompts), limit=limit, allow_download=allow_download)
    if not isinstance(prompts, Iterable):
        raise APIError(f"prompts: expected a prompt spec or a list of texts, got {prompts!r:.60}")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, Prompt)) or (isinstance(p, str) and not p.strip()):
            raise APIError(f"prompts[{i}]: expected a non-empty prompt text (str), got {p!r:.60}")
        out.append(p if isinstance(p, Prompt) else Prompt(f"p{i}", p, None, "python"))
    if not out:
        raise APIError("prompts: the list is empty")
    return out[:limit] if limit is not None else out


def generate_rollouts(
    target: Target,
    prompts: str | Sequence[str | Prompt],
    out: str | Path,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    limit: int | None = None,
    batch_size: int = 8,
    shard_size: int = 64,
    store_topk: int = 0,
    allow_download: bool = False,
    progress: bool = True,
) -> RolloutSet:
    """`blockdraft rollout`: one target response per prompt, written to `out` (resumed
    when `out` holds an unfinished set). Returns the finished `RolloutSet`.

        >>> greedy = {"temperature": 0, "max_new_tokens": 32}
        >>> rollouts = blockdraft.generate_rollouts(
        ...     target, "examples/prompts.jsonl", "rollouts/train", **greedy
        ... )
        >>> heldout = blockdraft.generate_rollouts(
        ...     target, "examples/heldout.jsonl", "rollouts/heldout", **greedy
        ... )
        >>> print(len(rollouts), rollouts.manifest["num_response_tokens"])
    """
    _target(target, "generate_rollouts")
    _check_numbers(
        "generate_rollouts", temperature=temperature, top_p=top_p, top_k=top_k,
        max_new_tokens=max_new_tokens, seed=seed, limit=limit, batch_size=batch_size,
        shard_size=shard_size, store_topk=store_topk,
    )  # fmt: skip
    settings = SamplingSettings(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    return _generate_rollouts(
        target,
        _prompt_list(prompts, limit, allow_download),
        out,
        settings,
        batch_size=batch_size,
        shard_size=shard_size,
        store_topk=store_topk,
        progress=progress,
        prompt_spec=str(prompts) if isinstance(prompts, (str, Path)) else None,
    )


def open_rollouts(directory: str | Path, *, allow_incomplete: bool = False) -> RolloutSet:
    """A rollout set written earlier (by `blockdraft rollout` or `generate_rollouts`).

    >>> rollouts = blockdraft.open_rollouts("rollouts/train")
    >>> print(target.decode(rollouts[0].response_ids.tolist()))
    """
    return RolloutSet.open(directory, allow_incomplete=allow_incomplete)


def train(
    config: str | Path | Mapping[str, Any] | TrainConfig | None = None,
    overrides: Mapping[str, Any] | Sequence[str] = (),
    *,
    target: Target | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """`blockdraft train`: train a drafter; returns its `final/` checkpoint directory.

    `config` is a YAML file (`configs/tiny.yaml`), a nested dict, a `TrainConfig` or None
    (the defaults); `overrides` are dotted keys as on the command line, either
    `["optim.max_steps=5"]` or `{"optim.max_steps": 5}`. An already loaded `target` saves
    loading it again. Metrics go to `<run_dir>/metrics.jsonl`.

        >>> final = blockdraft.train(
        ...     "configs/tiny.yaml",
        ...     {"run_dir": "runs/quick", "data.train_rollouts": "rollouts/train",
        ...      "data.eval_rollouts": "rollouts/heldout", "optim.max_steps": 5},
        ...     target=target,
        ... )
    """
    if isinstance(overrides, Mapping):
        # JSON is YAML, and the command line parses each value as YAML
        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str) or not isinstance(overrides, Iterable):
        raise APIError(
            f"train: overrides must be a dict or a list of 'key=value' strings, got "
            f"{overrides!r:.60}"
        )
    overrides = list(overrides)
    if target is not None:
        _target(target, "train")
    if isinstance(config, TrainConfig):
        cfg = config_from_dict(config.to_dict(), overrides) if overrides else config
    elif isinstance(config, Mapping):
        cfg = config_from_dict(dict(config), overrides)
    elif isinstance(config, (str, Path)):  # a file, or a shipped recipe's name (`"tiny"`)
        cfg = load_config(resolve_recipe(config, TRAIN, "config"), overrides)
    elif config is None:
        cfg = load_config(None, overrides)
    else:
        raise APIError(f"train: config must be a path, a dict or a TrainConfig, got {config!r:.60}")
    return _train(cfg, target=target, resume=resume, overwrite=overwrite)


def load_drafter(
    spec: str | Path | DrafterSpec, target: Target, *, dtype: str | None = None
) -> Any:
    """A drafter bound to `target` for decoding: a checkpoint or run directory (its
    `final/`), `ngram[:k=7,max=3,min=1]` (prompt lookup), `suffix[:k=7]` (suffix decoding),
    `hybrid:RUN` or `trim:RUN`.

        >>> drafter = blockdraft.load_drafter("runs/quick", target)
        >>> print(drafter.config.block_size)
    """
    dt = _drafter_dtype(dtype, _target(target, "load_drafter"))
    return load_drafter_spec(DrafterSpec.parse(spec), target, dtype=dt)[0]


def _drafter_dtype(dtype: str | None, target: Target) -> torch.dtype | None:
    """None keeps a drafter's own dtype beside a CPU target and takes a GPU target's, as
    the commands do (`--drafter-dtype auto`); a name (`"bfloat16"`) casts it."""
    on_gpu = torch.device(target.device).type == "cuda"
    spec = str(target.dtype).removeprefix("torch.") if on_gpu else "auto"
    return drafter_dtype(spec, target.device, dtype)


def evaluate(
    target: Target,
    drafters: Paths,
    rollouts: Paths,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    allow_incomplete: bool = False,
    drafter_dtype: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """`blockdraft eval --json`: exact offline MAL (with a bootstrap 95% CI), expected
    rounds, `ar_k` and `t_ge_k` of each drafter on each rollout set ("benchmark").

        >>> scores = blockdraft.evaluate(target, ["ngram", "runs/quick"], "rollouts/heldout")
        >>> print([(d["name"], d["mal"]) for d in scores["benchmarks"][0]["drafters"]])
    """
    _target(target, "evaluate")
    _check_numbers("evaluate", n_boot=n_boot, seed=seed)
    return eval_compare.evaluate(
        target,
        _specs(drafters, check=True),
        _many(rollouts, "rollouts"),
        n_boot,
        seed,
        cache_dir,
        progress=progress,
        allow_incomplete=allow_incomplete,
        drafter_dtype=_drafter_dtype(drafter_dtype, target),
    )


def compare(
    target: Target,
    drafters: Paths,
    rollouts: Paths,
    *,
    all_pairs: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    allow_incomplete: bool = False,
    drafter_dtype: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """`blockdraft compare --json`: the paired MAL gain (`mal_gain`, `rel_gain`, each with a
    95% CI that resamples rollouts for both drafters together) of each drafter over the
    first (or of every pair) on the same rollouts.

        >>> gains = blockdraft.compare(target, ["ngram", "runs/quick"], "rollouts/heldout")
        >>> print(gains["comparisons"][0]["mal_gain"], gains["comparisons"][0]["mal_gain_ci95"])
    """
    _target(target, "compare")
    _check_numbers("compare", n_boot=n_boot, seed=seed)
    rows = eval_compare.compare(
        target,
        _specs(drafters, check=True),
        _many(rollouts, "rollouts"),
        all_pairs,
        n_boot,
        seed,
        cache_dir,
        progress=progress,
        allow_incomplete=allow_incomplete,
        drafter_dtype=_drafter_dtype(drafter_dtype, target),
    )
    return {"comparisons": rows}


def run_suite(
    target: Target,
    suite: str | Path | Suite | None = None,
    drafters: Paths = (),
    *,
    benchmarks: Mapping[str, str] | None = None,
    limit: int | None = None,
    baseline: str | DrafterSpec | None = None,
    data_dir: str | Path | None = None,
    rollouts_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    split: bool = False,
    drafter_dtype: str | None = None,
    allow_download: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """`blockdraft suite --json`: every drafter, the baseline (prompt lookup) first, on
    every benchmark of a suite, with the mean over benchmarks and paired gains. Missing
    benchmark rollouts are generated and cached (`rollouts_dir`, default the user cache).

    `suite` is a suite file (`configs/suites/*.yaml`) or a `Suite`; `benchmarks` adds
    `{name: prompt spec}` (as `--benchmark NAME=SPEC`); `limit` caps each benchmark.

        >>> table = blockdraft.run_suite(
        ...     target, None, ["runs/quick"], limit=4,
        ...     benchmarks={"heldout": "examples/heldout.jsonl"}, rollouts_dir="rollouts/suite",
        ... )
        >>> print([(m["name"], m["mal"]) for m in table["mean"]])
    """
    _target(target, "run_suite")
    _check_numbers("run_suite", n_boot=n_boot, seed=seed, limit=limit)
    if isinstance(suite, Suite):
        chosen = suite
    elif suite is not None:
        chosen = load_suite(suite, data_dir=data_dir)
    else:
        chosen = Suite("python", benchmarks=[])
    extra = [benchmark_arg(f"{name}={spec}") for name, spec in (benchmarks or {}).items()]
    if not chosen.benchmarks and not extra:
        raise ValueError("run_suite: give a suite file or benchmarks={name: prompt spec}")
    base = DrafterSpec.parse(baseline) if baseline else None
    chosen = with_benchmarks(chosen, extra, limit, base)
    names = _specs(drafters, check=True)
    return _run_suite(
        target,
        chosen,
        names,
        rollouts_root=rollouts_dir,
        cache_dir=cache_dir,
        n_boot=n_boot,
        seed=seed,
        progress=progress,
        drafter_dtype=_drafter_dtype(drafter_dtype, target),
        log=print if progress else (lambda *_: None),
        split=split,
        allow_download=allow_download,
    )


def decode(
    target: Target,
    drafter: str | Path | DrafterSpec,
    prompts: str | Sequence[str | Prompt],
    *,
    limit: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    verifier: str = "standard",
    measure_ar: bool = True,
    drafter_dtype: str | None = None,
    allow_download: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """`blockdraft decode --json`: real speculative decoding at batch 1 with `tau` (tokens
    per round) and its CI, tokens/s and, unless `measure_ar=False`, the `speedup` over
    autoregressive decoding timed alternately in the same call. `outputs` holds the token
    ids (`target.decode(ids)` for text).

        >>> decoded = blockdraft.decode(target, "runs/quick", ["def fib(n):"], max_new_tokens=32)
        >>> print(decoded["tau"], decoded["speedup"], target.decode(decoded["outputs"][0]))
    """
    _target(target, "decode")
    _check_numbers(
        "decode", limit=limit, temperature=temperature, top_p=top_p, top_k=top_k,
        max_new_tokens=max_new_tokens, seed=seed,
    )  # fmt: skip
    loaded = _prompt_list(prompts, limit, allow_download)
    spec = DrafterSpec.parse(drafter)
    ckpt = checkpoint_of(spec)
    model = load_drafter(spec, target, dtype=drafter_dtype)
    result = _decode(
        target,
        model,
        [render_prompt(target.tokenizer, p) for p in loaded],
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
        verifier=verifier,
        measure_ar=measure_ar,
        progress=progress,
    )
    return {
        "drafter": eval_compare.drafter_names([spec])[0],
        "path": str(ckpt) if ckpt is not None else None,
        "target": target.name,
        "drafter_dtype": str(getattr(model, "dtype", "")).removeprefix("torch.") or None,
        **result.to_dict(),
    }


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    target: Target | None = None,
    overwrite: bool = False,
    expand_vocab: bool = False,
    hybrid_conf: float | None = None,
    trim_conf: float | None = None,
) -> Path:
    """`blockdraft export`: a serving-ready copy of a drafter (SGLang, vLLM, z-lab's
    loader), validated before it is moved into place; returns the output directory.

    `dtype` casts the weights (`"bfloat16"` for engines); a reduced draft vocabulary needs
    its `target` for the LM-head rows, or `expand_vocab` to score the whole vocabulary
    (what llama.cpp loads; it changes the proposals, so score it). `hybrid_conf` exports
    the `hybrid:conf=C` spec (prompt lookup as a per-slot fallback), `trim_conf` the
    `trim:conf=C` spec (each block cut before its first slot below C); both are served by
    blockdraft's vLLM plugin only.

        >>> print(blockdraft.export("runs/quick", "export/quick"))
    """
    if target is not None:
        _target(target, "export")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise APIError(f"export: dtype must be float32, bfloat16 or float16, got {dtype!r:.40}")
    return export_drafter(
        resolve_checkpoint(checkpoint),
        out,
        dtype=getattr(torch, dtype) if dtype else None,
        target=target,
        overwrite=overwrite,
        expand_vocab=expand_vocab,
        hybrid_conf=hybrid_conf,
        trim_conf=trim_conf,
    )
