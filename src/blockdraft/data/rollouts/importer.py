"""`blockdraft rollout-import`: responses generated elsewhere -> a rollout set.

Why: a serving engine generates far faster than HF modelling code, but returns the
target's log-probs only partially (top few, its own processing), so we keep only its
tokens and recompute every response token's log-prob in one teacher-forced batched pass
with exactly `blockdraft rollout`'s processing: the set is indistinguishable from one
`rollout` wrote. A response that cannot be a rollout of this target under the stated
settings is dropped with its reason counted (docs/rollouts.md). The whole file is scored
before the first shard is written, so a drop never moves rows between shards on resume.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockdraft.artifacts import writer_lock
from blockdraft.data.prompt_specs import render_prompt
from blockdraft.data.prompt_type import Prompt, PromptError
from blockdraft.data.rollouts.distributed import extend_prefix, plan_tasks, remove_parts
from blockdraft.data.rollouts.generate import (
    check_finished_rows,
    finish_manifest,
    open_or_create_set,
    repair_damaged_shards,
    set_header,
    stored_topk,
    write_shard,
)
from blockdraft.data.rollouts.import_records import EngineRecord, read_records
from blockdraft.data.rollouts.store import (
    MANIFEST,
    Rollout,
    RolloutError,
    RolloutSet,
    write_manifest,
)
from blockdraft.data.rollouts.teacher_forcing import score_responses
from blockdraft.sampling import SamplingSettings
from blockdraft.targets.target import Target

ENGINE_ERROR = "the engine reported an error"
NO_ROUND_TRIP = "text does not round-trip through the tokenizer"
EMPTY = "empty response"
OUT_OF_VOCAB = "token id outside the target's vocabulary"
PAST_STOP = "continues past a stop token"
TOO_LONG = "longer than max_new_tokens"
TOO_LONG_CONTEXT = "longer than the target's context"
DUPLICATE = "duplicate id"
OTHER_SETTINGS = "states other sampling settings than the set's"
NO_PROMPT = "id not found in --prompts"
FILTERED = "has a token the stated top-k/top-p removes (engine used other settings?)"


@dataclass
class ImportReport:
    """What an import did: rows written, drops by reason (with line numbers), warnings."""

    records: int
    rollouts: RolloutSet
    dropped: dict[str, list[int]] = field(default_factory=dict)
    greedy_mismatches: int = 0

    @property
    def imported(self) -> int:
        return len(self.rollouts)

    def summary(self) -> str:
        lines = [
            f"imported {self.imported} of {self.records} responses -> {self.rollouts.directory}"
        ]
        total = sum(len(v) for v in self.dropped.values())
        if total:
            lines.append(f"dropped {total}:")
            for reason, where in sorted(self.dropped.items(), key=lambda kv: -len(kv[1])):
                shown = ", ".join(str(n) for n in where[:5]) + (", ..." if len(where) > 5 else "")
                lines.append(f"  {len(where)} {reason} (line {shown})")
        if self.greedy_mismatches:
            lines.append(
                f"warning: {self.greedy_mismatches} greedy responses differ from this target's "
                "argmax somewhere (engine precision or another model?)"
            )
        return "\n".join(lines)


def import_rollouts(
    target: Target,
    path: str | Path,
    out_dir: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    prompts: list[Prompt] | None = None,
    store_topk: int = 0,
    shard_size: int = 256,
    batch_tokens: int = 8192,
    eos: str = "auto",
    limit: int | None = None,
    progress: bool = True,
) -> ImportReport:
    """Import the responses of a JSONL file (`import_records` lists the dialects).

    `overrides` are sampling settings stated by the caller (CLI flags); they take
    precedence over settings found in the records. `prompts` supplies prompts by id for
    records that carry none. `eos="auto"` appends the target's end-of-sequence token
    when the engine says it stopped on one but left it out (as text output does).
    """
    path = Path(path)
    if eos not in ("auto", "never"):
        raise ValueError(f"eos must be 'auto' or 'never', got {eos!r}")
    records = list(read_records(path))[:limit]
    if not records:
        raise RolloutError(f"{path}: no responses in the file")
    by_id = {p.id: p for p in prompts or []}
    dropped: dict[str, list[int]] = defaultdict(list)
    stated = _resolve_settings(path, records, overrides or {})
    rows = _tokenise(target, path, records, by_id, stated, eos, dropped)
    if not rows:
        raise RolloutError(f"{path}: every response was dropped ({_reasons(dropped)})")
    longest = max(len(r[2]) for r in rows)
    settings = SamplingSettings(
        **dict(stated, max_new_tokens=stated.get("max_new_tokens", longest))
    )
    store_topk = stored_topk(store_topk, settings, target.vocab_size)
    scored = score_responses(
        target, [(r[1], r[2]) for r in rows], settings, store_topk, batch_tokens, progress
    )
    kept, greedy_bad = [], 0
    for (rec, p_ids, r_ids), (lp, tk_ids, tk_lps, argmax_ok) in zip(rows, scored, strict=True):
        if not torch.isfinite(lp).all():
            dropped[FILTERED].append(rec.line)
            continue
        greedy_bad += settings.greedy and not argmax_ok
        kept.append(Rollout(rec.id, torch.tensor(p_ids), torch.tensor(r_ids), lp, tk_ids, tk_lps))
    if not kept:
        raise RolloutError(f"{path}: every response was dropped ({_reasons(dropped)})")
    with writer_lock(out_dir, "a rollout set"):  # one writer; a second is refused by pid
        rs = _write(target, path, out_dir, settings, kept, store_topk, shard_size, dropped)
    return ImportReport(len(records), rs, dict(dropped), greedy_bad)


def _reasons(dropped: dict[str, list[int]]) -> str:
    return "; ".join(f"{len(v)} {k}" for k, v in dropped.items())


def _resolve_settings(
    path: Path, records: list[EngineRecord], overrides: dict[str, Any]
) -> dict[str, Any]:
    """Flags over the first record's stated settings (validated; max_new_tokens may be absent)."""
    stated = next((r.settings for r in records if r.settings), None) or {}
    merged = dict(stated, **overrides)
    if "temperature" not in merged:
        raise RolloutError(
            f"{path}: sampling settings not stated: pass --temperature (and --top-p, --top-k, "
            "--max-new-tokens as used) or put a 'settings' object in the records"
        )
    try:
        SamplingSettings(**dict({"max_new_tokens": 1}, **merged))
    except (TypeError, ValueError) as exc:
        raise RolloutError(f"{path}: bad sampling settings ({exc})") from None
    return merged


def _tokenise(
    target: Target,
    path: Path,
    records: list[EngineRecord],
    by_id: dict[str, Prompt],
    stated: dict[str, Any],
    eos: str,
    dropped: dict[str, list[int]],
) -> list[tuple[EngineRecord, list[int], list[int]]]:
    """(record, prompt ids, response ids) of every usable record; drops recorded by reason."""
    tok, vocab = target.tokenizer, target.vocab_size
    stops = set(target.stop_token_ids)
    limit = stated.get("max_new_tokens")
    context = getattr(target.config, "max_position_embeddings", None)
    seen: set[str] = set()
    default = SamplingSettings().to_dict()
    out = []
    for rec in records:

        def drop(reason: str, rec: EngineRecord = rec) -> None:
            dropped[reason].append(rec.line)

        if rec.error is not None:
            drop(ENGINE_ERROR)
            continue
        if rec.no_response:  # e.g. `choices: []` or `content: null`
            drop(EMPTY)
            continue
        own = {k: v for k, v in (rec.settings or {}).items() if k not in ("seed", "max_new_tokens")}
        if any(stated.get(k, default.get(k)) != v for k, v in own.items()):
            drop(OTHER_SETTINGS)
            continue
        if rec.id in seen:
            drop(DUPLICATE)
            continue
        prompt_ids = _prompt_ids(tok, path, rec, by_id)
        if prompt_ids is None:
            drop(NO_PROMPT)
            continue
        if rec.response_ids is not None:
            ids = list(rec.response_ids)
        else:
            text = rec.response_text or ""
            try:
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
                same = tok.decode(ids, skip_special_tokens=False) == text
            except (TypeError, ValueError, UnicodeError):  # e.g. a lone surrogate
                same = False
            if not same:
                drop(NO_ROUND_TRIP)
                continue
        if eos == "auto" and rec.eos_stop and (not ids or ids[-1] not in stops) and stops:
            ids.append(rec.stop_token if rec.stop_token in stops else target.stop_token_ids[0])
        if not ids:
            drop(EMPTY)
        elif any(not 0 <= t < vocab for t in ids + prompt_ids):
            drop(OUT_OF_VOCAB)
        elif any(t in stops for t in ids[:-1]):
            drop(PAST_STOP)
        elif limit is not None and len(ids) > limit:
            drop(TOO_LONG)
        elif context is not None and len(prompt_ids) + len(ids) > context:
            drop(TOO_LONG_CONTEXT)
        else:
            seen.add(rec.id)
            out.append((rec, prompt_ids, ids))
    return out


def _prompt_ids(
    tok: Any, path: Path, rec: EngineRecord, by_id: dict[str, Prompt]
) -> list[int] | None:
    """Prompt token ids as `blockdraft rollout` renders them (None: not in --prompts)."""
    if rec.prompt_ids is not None:
        return list(rec.prompt_ids)
    if rec.messages is not None or rec.prompt_text is not None:
        prompt = Prompt(rec.id, rec.prompt_text, rec.messages, "import")
    elif by_id:
        prompt = by_id.get(rec.id)
        if prompt is None:
            return None
    else:
        raise RolloutError(
            f"{path}:{rec.line}: no prompt (looked for prompt_token_ids, prompt_ids, messages, "
            "prompt); pass --prompts SPEC to join prompts by id"
        )
    try:
        return render_prompt(tok, prompt)
    except (PromptError, ValueError, TypeError, KeyError) as exc:
        raise RolloutError(f"{path}:{rec.line}: cannot render the prompt ({exc})") from None


@torch.no_grad()
def _write(
    target: Target,
    path: Path,
    out_dir: str | Path,
    settings: SamplingSettings,
    rows: list[Rollout],
    store_topk: int,
    shard_size: int,
    dropped: dict[str, list[int]],
) -> RolloutSet:
    """Shards + manifest exactly as `generate_rollouts` writes them (resumable)."""
    out = Path(out_dir)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    header = set_header(target, settings, store_topk, f"import:{path.name}")
    manifest = open_or_create_set(out, header, batch_size=0, shard_size=shard_size)
    previous = manifest.get("import", {}).get("sha256")
    if previous not in (None, digest) or (previous is None and manifest["shards"]):
        raise RolloutError(
            f"{out / MANIFEST}: refusing to mix rollouts: import.sha256 differs (the set was "
            "made from another file or by `blockdraft rollout`); use another --out directory"
        )
    ids = [r.prompt_id for r in rows]
    tokens = [r.prompt_ids.tolist() for r in rows]
    pool: dict[int, dict[str, Any]] = {}
    repair_damaged_shards(out, manifest, pool, len(rows))  # a damaged shard: imported again
    check_finished_rows(out, manifest["shards"] + list(pool.values()), ids, tokens)
    manifest["import"] = {
        "file": str(path),
        "sha256": digest,
        "records": sum(len(v) for v in dropped.values()) + len(rows),
        "imported": len(rows),
        "dropped": {k: len(v) for k, v in dropped.items()},
        "logprobs": "recomputed by a teacher-forced pass of the target (blockdraft rollout-import)",
    }
    manifest["prompts"]["requested"] = max(len(rows), manifest["prompts"]["requested"])
    write_manifest(out, manifest)
    for task in plan_tasks(manifest, pool, len(rows), shard_size):
        a, b = task.first_row, task.first_row + task.rows
        pool[task.first_row] = write_shard(out, task, rows[a:b], ids[a:b], tokens[a:b], store_topk)
        extend_prefix(manifest, pool)
        finish_manifest(out, manifest)
    extend_prefix(manifest, pool)
    finish_manifest(out, manifest)
    if manifest["complete"]:
        remove_parts(out)
    return RolloutSet(out, manifest)
