"""Target rollouts: generate responses to prompts, append them in shards, resume after a crash.

`generate_rollouts` is the one entry point (the CLI `blockdraft rollout` and the demo
call it). Rows are generated in prompt order, one shard at a time; a shard is written
atomically and only then listed in `manifest.json`, so a killed run (even `kill -9`)
leaves every listed shard intact and the next run regenerates exactly the unlisted rows.
Batches never straddle shards and each rollout draws from its own seeded random stream,
so a resumed set equals an uninterrupted one, row for row. Under torchrun the shards are
dealt out to ranks and the same holds across processes (`distributed_rollouts`); shards
made elsewhere come in through `rollout_import` with the same writer.

A directory holds rollouts of one target under one set of sampling settings; asking to
add rollouts of another target or other settings is refused, naming the differing key.
Storage layout: see `blockdraft.data.rollout_store`.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from blockdraft import __version__
from blockdraft.data.distributed_rollouts import (
    ShardTask,
    extend_prefix,
    finished_beyond_prefix,
    manifest_digest,
    plan_tasks,
    rank_context,
    record_part,
    remove_parts,
)
from blockdraft.data.generation import SamplingSettings, generate_batch, sampling_logprobs
from blockdraft.data.prompts import Prompt, PromptError, check_fits_context, render_prompt
from blockdraft.data.rollout_store import (
    FORMAT,
    MANIFEST,
    VERSION,
    Rollout,
    RolloutError,
    RolloutSet,
    encode_shard,
    ids_hash,
    read_manifest,
    sha256_bytes,
    split_by_prompt,
    target_fingerprint,
    tokenizer_hash,
    verify_shard,
    write_atomic,
    write_manifest,
)
from blockdraft.models.target import Target

__all__ = [
    "Rollout",
    "RolloutError",
    "RolloutSet",
    "SamplingSettings",
    "generate_rollouts",
    "sampling_logprobs",
    "split_by_prompt",
]

LOGPROB_NOTE = (
    "log-probs and top-k are under the distribution each token was sampled from "
    "(logits / temperature, then top-k, then top-p); for greedy (temperature 0) under the "
    "plain T=1 softmax"
)


def generate_rollouts(
    target: Target,
    prompts: list[Prompt],
    out_dir: str | Path,
    settings: SamplingSettings,
    batch_size: int = 8,
    shard_size: int = 64,
    store_topk: int = 0,
    progress: bool = True,
    prompt_spec: str | None = None,
) -> RolloutSet:
    """Generate (or finish generating) one rollout per prompt into `out_dir`.

    Returns the finished set. Re-running with the same arguments after an interruption
    continues where the finished shards end; with more prompts it extends the set. Under
    an initialised process group (torchrun) every rank calls this with the same
    arguments and gets its share of the shards (`distributed_rollouts`).
    """
    if batch_size < 1 or shard_size < 1 or store_topk < 0:
        raise ValueError("batch_size and shard_size must be >= 1 and store_topk >= 0")
    if not prompts:
        raise PromptError("no prompts to generate rollouts for")
    ids = [p.id for p in prompts]
    dup = next((i for i, n in Counter(ids).items() if n > 1), None)
    if dup is not None:
        raise PromptError(f"duplicate prompt id {dup!r}: rollout seeds are derived from prompt ids")
    ctx = rank_context()
    out = Path(out_dir)
    spec = prompt_spec or ",".join(sorted({p.source for p in prompts}))
    header = _header(target, settings, store_topk, spec)
    tokens = [render_prompt(target.tokenizer, p) for p in prompts]
    check_fits_context(ids, tokens, target.context_length, settings.max_new_tokens)
    manifest: dict[str, Any] = {}
    pool: dict[int, dict[str, Any]] = {}
    plan: dict[str, Any]
    if ctx.rank == 0:
        try:
            manifest = _open_or_create(out, header, batch_size, shard_size)
            pool = finished_beyond_prefix(out, manifest)
            _check_finished(out, manifest["shards"] + list(pool.values()), ids, tokens)
            extend_prefix(manifest, pool)
            manifest["prompts"]["requested"] = max(len(prompts), manifest["prompts"]["requested"])
            write_manifest(out, manifest)
            tasks = plan_tasks(manifest, pool, len(prompts), shard_size)
            plan = {"tasks": tasks, "digest": manifest_digest(out)}
        except (RolloutError, PromptError) as exc:
            plan = {"error": (type(exc).__name__, str(exc))}
    plan = ctx.broadcast(plan if ctx.rank == 0 else None)
    if "error" in plan:
        kind, msg = plan["error"]
        raise (PromptError if kind == "PromptError" else RolloutError)(msg)
    if ctx.rank != 0 and manifest_digest(out) != plan["digest"]:
        raise RolloutError(
            f"{out / MANIFEST}: rank {ctx.rank} does not see rank 0's manifest; all ranks "
            "need the same --out directory (a shared filesystem across nodes)"
        )
    mine = plan["tasks"][ctx.rank :: ctx.world_size]
    done = len(prompts) - sum(t.rows for t in plan["tasks"])
    if ctx.rank == 0 and done > 0:  # say so: the set was not started from scratch
        print(f"resuming: {done} of {len(prompts)} prompts already done ({out})", flush=True)
    bar = tqdm(
        total=sum(t.rows for t in mine),
        unit="rollout",
        desc="rollouts" if not ctx.distributed else f"rollouts (rank 0 of {ctx.world_size})",
        disable=not progress or ctx.rank != 0,
        dynamic_ncols=True,
    )
    meter = _Meter(bar)
    try:
        for task in mine:
            a, b = task.first_row, task.first_row + task.rows
            rows = _generate_shard(
                target, ids[a:b], tokens[a:b], settings, batch_size, store_topk, meter
            )
            entry = _write_shard(out, task, rows, ids[a:b], tokens[a:b], store_topk)
            if ctx.distributed:
                record_part(out, ctx.rank, entry)
            if ctx.rank == 0:
                pool[entry["first_row"]] = entry
                pool.update(finished_beyond_prefix(out, manifest) if ctx.distributed else {})
                if extend_prefix(manifest, pool):
                    _finish_manifest(out, manifest)
    finally:
        bar.close()
    ctx.barrier()
    if ctx.rank == 0:
        pool.update(finished_beyond_prefix(out, manifest))
        extend_prefix(manifest, pool)
        _finish_manifest(out, manifest)
        if manifest["num_rollouts"] >= len(prompts):
            remove_parts(out)
    ctx.barrier()
    return RolloutSet(out, manifest if ctx.rank == 0 else read_manifest(out) or {})


def _finish_manifest(out: Path, manifest: dict[str, Any]) -> None:
    manifest["complete"] = manifest["num_rollouts"] >= manifest["prompts"]["requested"]
    write_manifest(out, manifest)


class _Meter:
    """Progress bar counting rollouts, with the generated tokens/s of this session."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.tokens, self.start = bar, 0, time.perf_counter()

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
        self.bar.update(rows)


def _header(
    target: Target, settings: SamplingSettings, store_topk: int, spec: str
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": {
            "name": target.name,
            "fingerprint": target_fingerprint(target),
            "tokenizer_hash": tokenizer_hash(target.tokenizer),
            "vocab_size": target.vocab_size,
            "stop_token_ids": list(target.stop_token_ids),
        },
        "settings": settings.to_dict(),
        "store_topk": store_topk,
        "logprobs": LOGPROB_NOTE,
        "prompts": {"spec": spec, "requested": 0},
    }


def _compat_items(manifest: dict[str, Any]) -> dict[str, Any]:
    """The keys that must agree before rollouts may be added to an existing directory."""
    target = manifest.get("target", {})
    items = {
        f"target.{k}": target.get(k) for k in ("fingerprint", "tokenizer_hash", "stop_token_ids")
    }
    items.update({f"settings.{k}": v for k, v in manifest.get("settings", {}).items()})
    items["store_topk"] = manifest.get("store_topk")
    return items


def _open_or_create(
    out: Path, header: dict[str, Any], batch_size: int, shard_size: int
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is None:
        ours = {MANIFEST} | {p.name for p in out.glob(".*.tmp")}
        others = [p.name for p in out.iterdir() if p.name not in ours]
        if others:
            raise RolloutError(
                f"{out}: directory is not empty and has no {MANIFEST} "
                f"(found {others[0]}); choose a new or empty --out directory"
            )
        manifest = dict(
            header,
            created_by=f"blockdraft {__version__}",
            python=platform.python_version(),
            batch_size=batch_size,
            shard_size=shard_size,
            num_rollouts=0,
            num_response_tokens=0,
            complete=False,
            shards=[],
        )
        write_manifest(out, manifest)
    else:
        _check_compatible(out, manifest, header)
    for stale in out.glob(".*.tmp"):  # a write that was killed before its rename
        stale.unlink()
    return manifest


def _check_compatible(out: Path, manifest: dict[str, Any], header: dict[str, Any]) -> None:
    stored, new = _compat_items(manifest), _compat_items(header)
    for key in list(new) + [k for k in stored if k not in new]:
        if stored.get(key) != new.get(key):
            what = key
            if key.startswith("target."):
                old_name, new_name = (
                    manifest.get("target", {}).get("name"),
                    header["target"]["name"],
                )
                what += f" (stored target {old_name!r}, now {new_name!r})"
            _mismatch(out, what, stored.get(key), new.get(key))


def _mismatch(out: Path, key: str, stored: Any, new: Any) -> None:
    def short(v: Any) -> str:
        s = repr(v)
        return s if len(s) <= 24 else s[:21] + "..."

    raise RolloutError(
        f"{out / MANIFEST}: refusing to mix rollouts: {key} differs (stored {short(stored)}, "
        f"requested {short(new)}); use another --out directory"
    )


def _check_finished(
    out: Path, shards: list[dict[str, Any]], ids: list[str], tokens: list[list[int]]
) -> None:
    """Finished shards must be intact and hold the same prompts, in order, as requested now."""
    for shard in shards:
        verify_shard(out, shard)
        a, b = shard["first_row"], shard["first_row"] + shard["rows"]
        if b > len(ids):
            continue  # stored set is longer than this request; nothing to compare or add
        if ids_hash(ids[a:b], tokens[a:b]) != shard["prompts_sha256"]:
            raise RolloutError(
                f"{out / shard['file']}: rows {a}..{b - 1} were generated for other prompts "
                "(prompt ids, order or rendering changed); use another --out directory"
            )


def _generate_shard(
    target: Target,
    ids: list[str],
    tokens: list[list[int]],
    settings: SamplingSettings,
    batch_size: int,
    store_topk: int,
    meter: _Meter,
) -> list[Rollout]:
    """Rows of one shard, batched by prompt length (less padding); returned in prompt order."""
    order = sorted(range(len(ids)), key=lambda i: (len(tokens[i]), i))
    rows: list[Rollout | None] = [None] * len(ids)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        gens = generate_batch(
            target, [tokens[i] for i in batch], [ids[i] for i in batch], settings, store_topk
        )
        for i, g in zip(batch, gens, strict=True):
            rows[i] = Rollout(
                ids[i],
                torch.tensor(tokens[i], dtype=torch.long),
                torch.tensor(g.response_ids, dtype=torch.long),
                torch.tensor(g.logprobs, dtype=torch.float32),
                g.topk_ids,
                g.topk_logprobs,
            )
        meter.update(len(batch), sum(len(g.response_ids) for g in gens))
    return rows  # type: ignore[return-value]


def _write_shard(
    out: Path,
    task: ShardTask,
    rows: list[Rollout],
    ids: list[str],
    tokens: list[list[int]],
    store_topk: int,
) -> dict[str, Any]:
    """Write one shard atomically; return its manifest entry (listed by the caller)."""
    data = encode_shard(task.first_row, rows, store_topk)
    write_atomic(out / task.file, data)
    return {
        "file": task.file,
        "first_row": task.first_row,
        "rows": len(rows),
        "response_tokens": sum(r.response_len for r in rows),
        "bytes": len(data),
        "sha256": sha256_bytes(data),
        "prompts_sha256": ids_hash(ids, tokens),
    }
