"""Where a training step gets the drafter's context features: the live target or a cache.

Steps call one `FeatureSource` and never branch on where features come from:
`OnlineTargetFeatures` runs the frozen target (the only source of the logits sampling
E2E/EDR need); `CachedFeatures` reads what `blockdraft features` stored (`data.features`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from blockdraft.data.feature_store import FeatureError, FeatureStore, rollout_set_id, truncated_span
from blockdraft.data.rollouts.store import read_manifest, target_fingerprint
from blockdraft.targets.target import TargetOutput
from blockdraft.training.batching import Batch
from blockdraft.training.builders import TrainSetupError
from blockdraft.training.target_distributions import stored_topk_is_whole

KEY = "data.features"


class FeatureSource(Protocol):
    def features(
        self, batch: Batch, *, with_logits: bool = False, logits_to_keep: int = 0
    ) -> TargetOutput:
        """`TargetOutput(logits [B,T,V] | None, features [B,T,F])` for a padded batch
        (`logits_to_keep`: logits of the last positions only, as `Target.forward`)."""
        ...


class OnlineTargetFeatures:
    """Features (and logits when asked) from a forward of the frozen target."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def features(
        self, batch: Batch, *, with_logits: bool = False, logits_to_keep: int = 0
    ) -> TargetOutput:
        return self.target.forward(
            batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            with_logits=with_logits,
            logits_to_keep=logits_to_keep,
        )


class CachedFeatures:
    """Features of training rollouts read from a `blockdraft features` directory, matched
    to `rollouts` (what `Batch.rollout_index` indexes) by prompt id, so a held-out split
    of the set works."""

    def __init__(
        self,
        store: FeatureStore,
        rollouts: list,
        max_seq_len: int,
        *,
        target: Any = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.store, self.target = store, target
        self.dtype, self.device = dtype, torch.device(device)
        self.feature_size = int(store.manifest["feature_size"])
        where = {pid: row for row, pid in enumerate(store.prompt_ids())}
        self._rows = []
        for r in rollouts:
            row = where.get(r.prompt_id)
            if row is None:
                raise TrainSetupError(
                    f"{KEY}: {store.directory} has no row for prompt {r.prompt_id!r}"
                )
            _, cut, stored = store.row_info(row)
            want_cut, want = truncated_span(r.prompt_len, r.response_len, max_seq_len)
            if want_cut != cut or want > stored:
                raise TrainSetupError(
                    f"data.max_seq_len: {max_seq_len} truncates prompt {r.prompt_id!r} other "
                    f"than the features in {store.directory} (max_seq_len "
                    f"{store.manifest['max_seq_len']}); recompute with --max-seq-len {max_seq_len}"
                )
            self._rows.append(row)

    @classmethod
    def open(
        cls,
        directory: str | Path,
        *,
        target: Any,
        rollout_dir: str | Path,
        rollouts: list,
        max_seq_len: int,
        device: torch.device | str = "cpu",
    ) -> CachedFeatures:
        """Open and check `directory` against this target, its layer ids and rollout set."""
        try:
            store = FeatureStore(directory, KEY)
        except FeatureError as exc:
            raise TrainSetupError(str(exc)) from None
        m = store.manifest
        fix = f"recompute with `blockdraft features --target ... --rollouts {rollout_dir}`"
        if m["target"]["fingerprint"] != target_fingerprint(target):
            raise TrainSetupError(
                f"{KEY}: {directory} was computed by target {m['target']['name']!r}, not by "
                f"{target.name!r} (fingerprints differ); {fix}"
            )
        if list(m["layer_ids"]) != list(target.layer_ids):
            raise TrainSetupError(
                f"{KEY}: {directory} holds target layers {m['layer_ids']} but training uses "
                f"target.layer_ids {list(target.layer_ids)}; {fix}"
            )
        rid = rollout_set_id(read_manifest(Path(rollout_dir)) or {})
        if m["rollouts"]["set_id"] != rid:
            raise TrainSetupError(
                f"{KEY}: {directory} was computed from another rollout set "
                f"({m['rollouts']['directory']}) than data.train_rollouts {rollout_dir}; {fix}"
            )
        if not m.get("complete"):
            raise TrainSetupError(
                f"{KEY}: {directory} is incomplete ({m.get('num_rows', 0)} of "
                f"{m['rollouts']['num_rollouts']} rollouts); rerun `blockdraft features` to finish"
            )
        return cls(store, rollouts, max_seq_len, target=target, dtype=target.dtype, device=device)

    def features(
        self, batch: Batch, *, with_logits: bool = False, logits_to_keep: int = 0
    ) -> TargetOutput:
        if with_logits:
            raise TrainSetupError(
                f"{KEY}: cached features hold no target logits (this objective needs them)"
            )
        b, t = batch.input_ids.shape
        out = torch.zeros((b, t, self.feature_size), dtype=self.dtype)
        lengths = batch.attention_mask.sum(1).tolist()
        for i, idx in enumerate(batch.rollout_index.tolist()):
            n = int(lengths[i])
            out[i, :n] = self.store.row(self._rows[idx], n).to(self.dtype)
        return TargetOutput(logits=None, features=out.to(self.device))


def needs_target_logits(objective: Any, mode: str, train_data: Any = None) -> bool:
    """Sampling E2E/EDR compare with the target's distribution (its logits), unless every
    training rollout stores all of it (`target_distributions.stored_topk`); greedy ones
    need only q(label), the cross-entropy objectives only the features."""
    if not (bool(getattr(objective, "needs_target_distribution", False)) and mode == "sampling"):
        return False
    rollouts = getattr(train_data, "rollouts", None)
    if not rollouts or any(getattr(r, "topk_ids", None) is None for r in rollouts):
        return True
    stored_k = min(int(r.topk_ids.shape[-1]) for r in rollouts)
    return not stored_topk_is_whole(train_data.settings, stored_k)


def build_feature_source(
    cfg: Any, target: Any, train_data: Any, objective: Any, mode: str, *, say=print
) -> FeatureSource:
    """The run's feature source: online unless `data.features` is set. The cache is
    checked even when an objective needing target logits then trains online (a note)."""
    if not cfg.data.features:
        return OnlineTargetFeatures(target)
    cached = CachedFeatures.open(
        cfg.data.features,
        target=target,
        rollout_dir=cfg.data.train_rollouts,
        rollouts=train_data.rollouts,
        max_seq_len=cfg.data.max_seq_len,
        device=target.device,
    )
    if needs_target_logits(objective, mode, train_data):
        say(
            f"{KEY}: objective {cfg.objective.name!r} on sampling rollouts needs the target's "
            "distributions, which cached features do not store; training online (the target "
            "runs every step; rollouts written with --store-topk K under a top-k cutoff of at "
            "most K carry them whole)"
        )
        return OnlineTargetFeatures(target)
    return cached
