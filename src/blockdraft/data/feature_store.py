"""Cached target features on disk: safetensors shards plus a `manifest.json`, like rollouts.

Why cache them: a training step runs the frozen target over its batch only to read
`len(layer_ids)` hidden states per token, which never change for a fixed rollout set, so
`blockdraft features` computes them once and training reads them back (`data.features`).
This module reads and checks a features directory (`FeatureStore`) and owns its identity
(`rollout_set_id`, and the id its first rows had: `rollout_prefix_set_id`) and the
truncation rule both sides apply (`truncated_span`). Shard layout and size on disk:
docs/architecture.md ("data") and docs/training.md.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from blockdraft.artifacts import (
    check_file,
    listed_file,
    read_listing_manifest,
    safetensors_bytes,
    verify_mode,
)
from blockdraft.errors import BlockdraftError

FORMAT = "blockdraft-features"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FeatureError(BlockdraftError, ValueError):
    """A features directory is unusable or does not match; the message names file or key."""


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def rollout_set_id(manifest: dict[str, Any]) -> str:
    """Identity of a rollout set: target, sampling settings and the SHA-256 of every shard.

    Hashing the identity-bearing parts of the rollout manifest (not its bytes) keeps the
    id stable when `blockdraft rollout` rewrites bookkeeping fields such as `requested`,
    and changes it whenever a token could differ (another shard, another target).
    """
    ident = {
        "target": manifest.get("target", {}).get("fingerprint"),
        "settings": manifest.get("settings"),
        "shards": [(s["first_row"], s["rows"], s["sha256"]) for s in manifest.get("shards", [])],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def rollout_prefix_set_id(manifest: dict[str, Any], num_rows: int) -> str | None:
    """`rollout_set_id` of the set's first `num_rows` rollouts, as that smaller set had it.

    A rollout set grows by appending shards and never rewrites one, so the set it was at
    `num_rows` rollouts is its first shards up to that row: the same id when those shards
    end exactly there, None when no shard boundary falls at `num_rows`.
    """
    shards, rows = [], 0
    for shard in manifest.get("shards", []):
        if rows == num_rows:
            break
        shards.append(shard)
        rows += shard["rows"]
    return rollout_set_id({**manifest, "shards": shards}) if rows == num_rows else None


def truncated_span(prompt_len: int, response_len: int, max_seq_len: int | None) -> tuple[int, int]:
    """(prompt tokens cut from the start, sequence length kept) under `batching.truncate`."""
    if max_seq_len is None:
        return 0, prompt_len + response_len
    cut = max(0, prompt_len - (max_seq_len - 2))
    kept_prompt = prompt_len - cut
    return cut, kept_prompt + min(response_len, max_seq_len - kept_prompt)


def read_manifest(directory: Path, key: str = "features") -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FeatureError(f"{key}: {directory} is not a features directory (no {MANIFEST})")
    return read_listing_manifest(path, "features", FORMAT, VERSION, FeatureError)


def shard_path(directory: str | Path, entry: dict[str, Any]) -> Path:
    """Where a manifest entry's shard lies: inside `directory`, or a `FeatureError`."""
    return listed_file(directory, entry.get("file"), Path(directory) / MANIFEST, FeatureError)


def encode_shard(
    first_row: int, prompt_ids: list[str], rows: list[torch.Tensor], cuts: list[int]
) -> bytes:
    """Serialise one shard (`rows[i]` is `[T_i, F]` in the storage dtype)."""
    offsets = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64).cumsum(0)
    tensors = {
        "features": torch.cat(rows).contiguous(),
        "offsets": offsets,
        "prompt_cut": torch.tensor(cuts, dtype=torch.int64),
    }
    # a resumed shard is byte-identical to an uninterrupted one (sorted metadata)
    meta = {"rows": json.dumps({"first_row": first_row, "prompt_id": prompt_ids})}
    return safetensors_bytes(tensors, meta)


class FeatureStore:
    """Random access to the rows of a features directory (memory-mapped shards).

    Opening checks every listed shard against the size and SHA-256 its manifest records
    (`artifacts.check_file`, like rollout shards and checkpoints; `BLOCKDRAFT_VERIFY=size`
    for size only), so a truncated or altered shard is one line naming it, never a
    safetensors traceback or training on wrong features.
    """

    def __init__(self, directory: str | Path, key: str = "features") -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory, key)
        self._shards = self.manifest["shards"]
        sha256 = verify_mode() == "sha256"
        for shard in self._shards:
            check_file(
                shard_path(self.directory, shard),
                shard,
                FeatureError,
                sha256=sha256,
                hint="re-run the same `blockdraft features` command to compute it again",
            )
        self._starts = [s["first_row"] for s in self._shards]
        self._handles: dict[int, Any] = {}
        self._index: dict[int, tuple[list[int], list[int], list[str]]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    @property
    def num_rows(self) -> int:
        return sum(s["rows"] for s in self._shards)

    def _open(self, s: int):
        if s not in self._handles:
            path = shard_path(self.directory, self._shards[s])
            if not path.is_file():
                raise FeatureError(f"{path}: shard listed in the manifest is missing")
            try:
                handle = safe_open(str(path), framework="pt")
                meta = handle.metadata()
                self._index[s] = (
                    handle.get_tensor("offsets").tolist(),
                    handle.get_tensor("prompt_cut").tolist(),
                    json.loads(meta["rows"])["prompt_id"],
                )
            except OSError:
                raise
            except Exception as exc:  # SafetensorError is not a ValueError
                raise FeatureError(f"{path}: cannot read shard ({exc})") from None
            found, listed = len(self._index[s][2]), self._shards[s]["rows"]
            if found != listed or len(self._index[s][0]) != found + 1:
                raise FeatureError(
                    f"{path}: holds {found} rows but {self.directory / MANIFEST} lists "
                    f"{listed}; restore the manifest or compute the features again"
                )
            self._handles[s] = handle
        return self._handles[s]

    def locate(self, row: int) -> tuple[int, int]:
        """(shard index, row within the shard) of stored row `row`."""
        s = bisect.bisect_right(self._starts, row) - 1
        if s < 0 or row >= self._starts[s] + self._shards[s]["rows"]:
            raise IndexError(f"{self.directory}: no stored row {row}")
        return s, row - self._starts[s]

    def row_info(self, row: int) -> tuple[str, int, int]:
        """(prompt id, prompt tokens cut, stored length) of stored row `row`."""
        s, i = self.locate(row)
        self._open(s)
        offsets, cuts, ids = self._index[s]
        return ids[i], cuts[i], offsets[i + 1] - offsets[i]

    def prompt_ids(self) -> list[str]:
        out: list[str] = []
        for s in range(len(self._shards)):
            self._open(s)
            out.extend(self._index[s][2])
        return out

    def row(self, row: int, length: int | None = None) -> torch.Tensor:
        """Features `[T, F]` of stored row `row` (its first `length` positions if given)."""
        s, i = self.locate(row)
        handle = self._open(s)
        offsets = self._index[s][0]
        start, stop = offsets[i], offsets[i + 1]
        if length is not None:
            stop = min(stop, start + length)
        return handle.get_slice("features")[start:stop]
