"""Rollout sets on disk: safetensors shards plus a `manifest.json` that says what they are.

`RolloutSet.open(dir)` reads and checks a set; the manifest is the source of truth (what,
how, which shards are finished) and only listed shards count; a listed shard is never
rewritten. Safetensors (not pickle, not Arrow) because a shard is one small
self-describing file that can be written to a temporary name and renamed into place,
checksummed, and memory-mapped back without trusting its contents. Shard encoding:
`shards.py`; directory layout: docs/architecture.md ("data").
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from blockdraft.artifacts import (  # noqa: F401  (write_atomic, sha256_bytes re-exported)
    canonical_json,
    check_file,
    check_listed_files,
    file_problem,
    listed_file,
    read_listing_manifest,
    sha256_bytes,
    verify_mode,
    write_atomic,
)
from blockdraft.data.rollouts.shards import (  # noqa: F401  (re-exported: the public names)
    Rollout,
    decode_shard,
    encode_shard,
)
from blockdraft.errors import BlockdraftError
from blockdraft.sampling import SamplingSettings
from blockdraft.targets.fingerprint import legacy_target_fingerprint, target_fingerprint

FORMAT = "blockdraft-rollouts"
VERSION = 1
MANIFEST = "manifest.json"


class RolloutError(BlockdraftError, ValueError):
    """A rollout directory is unusable or incompatible; the message names file and key."""


# what to do about a damaged shard: `generate_rollouts` regenerates it on a rerun
REPAIR_HINT = "re-run the `blockdraft rollout` command that made the set to regenerate it"


# --- hashing and manifests ---------------------------------------------------------------


def tokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 of the vocabulary, special tokens and chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    extra = [
        getattr(tokenizer, "all_special_tokens", []),
        getattr(tokenizer, "chat_template", None),
    ]
    return hashlib.sha256(json.dumps([vocab, extra], default=str).encode()).hexdigest()


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, default=str).encode()).hexdigest()[:16]


def tokenizer_parts(tokenizer: Any) -> dict[str, Any]:
    """What `tokenizer_hash` covers, part by part, so a mismatch can say what changed."""
    return {
        "vocab_sha256": _sha(sorted(tokenizer.get_vocab().items())),
        "special_tokens": [str(t) for t in getattr(tokenizer, "all_special_tokens", [])],
        "chat_template_sha256": _sha(getattr(tokenizer, "chat_template", None)),
    }


def tokenizer_difference(stored: dict[str, Any] | None, tokenizer: Any) -> str:
    """What differs between a recorded `tokenizer_parts` and `tokenizer` ("" if unknown)."""
    if not isinstance(stored, dict):
        return ""
    now = tokenizer_parts(tokenizer)
    what = []
    if stored.get("vocab_sha256") != now["vocab_sha256"]:
        what.append("the vocabulary")
    old, new = list(stored.get("special_tokens") or []), now["special_tokens"]
    added = [t for t in new if t not in old]
    removed = [t for t in old if t not in new]
    if added:
        what.append(f"special tokens added: {', '.join(map(repr, added[:5]))}")
    if removed:
        what.append(f"special tokens removed: {', '.join(map(repr, removed[:5]))}")
    if not added and not removed and old != new:
        what.append("the order of the special tokens")
    if stored.get("chat_template_sha256") != now["chat_template_sha256"]:
        what.append("the chat template")
    return "; ".join(what)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    return read_listing_manifest(path, "rollout", FORMAT, VERSION, RolloutError)


def shard_path(directory: str | os.PathLike, entry: dict[str, Any]) -> Path:
    """Where a manifest entry's shard lies: inside `directory`, or a `RolloutError`."""
    return listed_file(directory, entry.get("file"), Path(directory) / MANIFEST, RolloutError)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Sorted keys: the same rollouts give the same manifest bytes (and set id)."""
    write_atomic(Path(directory) / MANIFEST, canonical_json(manifest))


def ids_hash(prompt_ids: Sequence[str], prompt_tokens: Sequence[Sequence[int]]) -> str:
    """Hash of a run of prompts (ids and rendered tokens): detects a changed prompt list."""
    return hashlib.sha256(
        json.dumps([list(prompt_ids), [list(t) for t in prompt_tokens]]).encode()
    ).hexdigest()


# --- reading ----------------------------------------------------------------------------


def rank_by_id(ids: Sequence[str], salt: str) -> list[int]:
    """Positions of `ids` ordered by SHA-256(salt, id): a choice that follows the ids alone,
    never the order rollouts were written (the held-out split and the nested subsets)."""
    keys = [hashlib.sha256(f"{salt}\x00{pid}".encode()).digest() for pid in ids]
    return sorted(range(len(ids)), key=keys.__getitem__)


def split_by_prompt(
    ids: Sequence[str], eval_fraction: float, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Reproducible train/eval split of positions in `ids`, decided by prompt id.

    Ids are ranked by a seeded hash and the `round(eval_fraction * n)` lowest go to eval
    (at least one when the fraction is positive and n >= 2), so the split depends only on
    the ids and the seed, never on the order rollouts were written. Returns sorted
    (train_indices, eval_indices).
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(ids)
    n_eval = round(eval_fraction * n)
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    eval_set = set(rank_by_id(ids, str(seed))[:n_eval])
    return [i for i in range(n) if i not in eval_set], sorted(eval_set)


def nested_subset(ids: Sequence[str], n: int) -> list[int]:
    """Sorted positions of `n` of `ids`, chosen by an unseeded hash of each prompt id.

    Why unseeded: a data-scaling curve needs every smaller set inside every larger one and
    the same data for every training seed; ranking by hash makes the choice depend only on
    the ids (not on order or domain), so a prefix of a mix is not over-represented.
    """
    if not 0 <= n <= len(ids):
        raise ValueError(f"a subset of {n} from {len(ids)} rows")
    return sorted(rank_by_id(ids, "subset")[:n])


STAGE_SET = "set"  # where a pipeline stage keeps its rollout set


class RolloutSet(Sequence):
    """Read access to the finished shards of a rollout directory (optionally a subset)."""

    def __init__(self, directory: Path, manifest: dict[str, Any], indices: list[int] | None = None):
        self.directory = Path(directory)
        self.manifest = manifest
        self._shards = manifest["shards"]
        self._starts = [s["first_row"] for s in self._shards]
        self._total = sum(s["rows"] for s in self._shards)
        self._indices = indices
        self._cache: tuple[int, list[Rollout]] | None = None

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike,
        *,
        allow_incomplete: bool = False,
        verify: str | None = None,
    ) -> RolloutSet:
        """Open a finished rollout set for reading, after checking it is whole and intact.

        Every listed shard must exist with its recorded size; with `verify="sha256"` (the
        default, `BLOCKDRAFT_VERIFY=size` for size only) its SHA-256 must match too, so a
        flipped byte is refused, never used (cost: docs/export.md#integrity-checks; each
        file is hashed once per process). A set whose `blockdraft rollout` was interrupted
        (`complete: false`) is refused unless `allow_incomplete`. A pipeline stage's
        directory (the demo's `rollouts/eval`) opens the set it holds (`set/`), so the
        path a stage prints is one the next command accepts.
        """
        directory = Path(directory)
        if not (directory / MANIFEST).exists() and (directory / STAGE_SET / MANIFEST).exists():
            directory = directory / STAGE_SET
        manifest = read_manifest(directory)
        if manifest is None:
            what = "no such directory" if not directory.exists() else "no rollout manifest"
            raise RolloutError(f"{directory / MANIFEST}: {what} (run `blockdraft rollout`)")
        for key in ("shards", "settings"):
            if key not in manifest:
                raise RolloutError(f"{directory / MANIFEST}: missing key {key!r}")
        try:
            SamplingSettings.from_dict(manifest["settings"])
        except (TypeError, ValueError, AttributeError) as exc:
            raise RolloutError(f"{directory / MANIFEST}: settings: {exc}") from None
        rs = cls(directory, manifest)
        if not rs.complete and not allow_incomplete:
            requested = manifest.get("prompts", {}).get("requested", "?")
            raise RolloutError(
                f"{directory / MANIFEST}: incomplete rollout set ({rs._total} of {requested} "
                "rollouts; `blockdraft rollout` was interrupted): re-run the same rollout "
                "command to finish it, or pass --allow-incomplete (train: "
                "data.allow_incomplete=true) to use the finished rows"
            )
        mode = verify or verify_mode()
        if mode not in ("sha256", "size"):
            raise ValueError(f"verify must be 'sha256' or 'size', got {mode!r}")
        rs.check_files(sha256=mode == "sha256")
        return rs

    def check_files(self, sha256: bool = True) -> None:
        """Every listed shard exists with its recorded size (and SHA-256): one-line errors."""
        for shard in self._shards:
            verify_shard(self.directory, shard, sha256)

    @property
    def settings(self) -> SamplingSettings:
        return SamplingSettings.from_dict(self.manifest["settings"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def __len__(self) -> int:
        return len(self._indices) if self._indices is not None else self._total

    def __getitem__(self, i: int) -> Rollout:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"rollout index {i} out of range for {len(self)} rollouts")
        i %= len(self)
        row = self._indices[i] if self._indices is not None else i
        s = bisect.bisect_right(self._starts, row) - 1
        return self._load(s)[row - self._starts[s]]

    def __iter__(self) -> Iterator[Rollout]:
        for i in range(len(self)):
            yield self[i]

    @property
    def prompt_ids(self) -> list[str]:
        """Prompt ids of the rollouts in this set (reads shard headers only)."""
        all_ids: list[str] = []
        for shard in self._shards:
            path = shard_path(self.directory, shard)
            try:
                with open(path, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
                ids = json.loads(header["__metadata__"]["prompt_id"])
            except (ValueError, KeyError, TypeError) as exc:
                raise RolloutError(f"{path}: unreadable shard header ({exc})") from None
            _check_rows(path, len(ids), shard)
            all_ids.extend(ids)
        return all_ids if self._indices is None else [all_ids[i] for i in self._indices]

    def subset(self, indices: Sequence[int]) -> RolloutSet:
        """A view with the given positions (of this set), e.g. from `split_by_prompt`."""
        base = self._indices if self._indices is not None else range(self._total)
        return RolloutSet(self.directory, self.manifest, [base[i] for i in indices])

    def split(self, eval_fraction: float, seed: int = 0) -> tuple[RolloutSet, RolloutSet]:
        """(train, eval) views split by prompt id (see `split_by_prompt`)."""
        train, ev = split_by_prompt(self.prompt_ids, eval_fraction, seed)
        return self.subset(train), self.subset(ev)

    def verify(self) -> None:
        """Check every listed shard against its recorded size and SHA-256."""
        for shard in self._shards:
            verify_shard(self.directory, shard)

    def _load(self, s: int) -> list[Rollout]:
        if self._cache is None or self._cache[0] != s:
            path = shard_path(self.directory, self._shards[s])
            try:
                rows = decode_shard(path.read_bytes())
            except OSError:
                raise
            except Exception as exc:  # SafetensorError is not a ValueError
                raise RolloutError(f"{path}: cannot read shard ({exc})") from None
            _check_rows(path, len(rows), self._shards[s])
            self._cache = (s, rows)
        return self._cache[1]


def _check_rows(path: Path, found: int, entry: dict[str, Any]) -> None:
    """A shard holds the rows its manifest entry says (an edited count would index past
    it or skip rows)."""
    if found != entry["rows"]:
        raise RolloutError(
            f"{path}: holds {found} rollouts but {path.parent / MANIFEST} lists "
            f"{entry['rows']}; restore the manifest or make the set again"
        )


def check_target(rollouts: RolloutSet, target: Any, what: str = "") -> None:
    """Refuse rollouts generated by another target (tokenizer, config or any weight).

    Sets written before fingerprints covered every weight are accepted when their
    (weaker) legacy fingerprint matches, with a warning on stderr.
    """

    stored = rollouts.manifest.get("target", {})
    where = f"{what}: " if what else ""
    src = rollouts.directory
    name = getattr(target, "name", "?")
    now = tokenizer_hash(target.tokenizer)
    if stored.get("tokenizer_hash") and stored["tokenizer_hash"] != now:
        diff = tokenizer_difference(stored.get("tokenizer_parts"), target.tokenizer)
        made_by = stored.get("name")
        whose = (
            f"with another tokenizer than target {name!r} has now"
            if not made_by or made_by == name  # one target, changed since: named once
            else f"by target {made_by!r}, whose tokenizer is not the one of target {name!r}"
        )
        raise RolloutError(
            f"{where}rollouts in {src} were made {whose} "
            f"({'changed: ' + diff + '; ' if diff else ''}"
            f"tokenizer hash {stored['tokenizer_hash'][:12]} != {now[:12]})"
        )
    made_with = stored.get("fingerprint")
    if not made_with or made_with == target_fingerprint(target):
        return

    if made_with == legacy_target_fingerprint(target):
        print(
            f"warning: {src / MANIFEST} has an old-style target fingerprint (64 embedding rows):"
            f" only the tokenizer, config and those rows of {name!r} could be checked",
            file=sys.stderr,
        )
        return
    made_by = stored.get("name")
    whose = (
        f"with other weights than target {name!r} has now"
        if not made_by or made_by == name  # one target, changed since: named once
        else f"by target {made_by!r} with other weights than target {name!r}"
    )
    raise RolloutError(
        f"{where}rollouts in {src} were generated {whose} "
        f"(fingerprint {made_with} != {target_fingerprint(target)})"
    )


def verify_shard(directory: Path, shard: dict[str, Any], sha256: bool = True) -> None:
    """The shard's size (and SHA-256) against its manifest entry (one line naming it)."""
    check_file(shard_path(directory, shard), shard, RolloutError, sha256=sha256, hint=REPAIR_HINT)
