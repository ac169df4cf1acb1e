"""Acceptance tensors of a drafter on a rollout set: the input of the offline evaluator.

Every round start of a rollout gets its own block, and all go through the drafter's
training forward (`forward_blocks`) on the features of *one* target forward, in chunks.
A proposal's acceptance is `1[argmax q = x]` on greedy rollouts and `min(1, q(x) / p(x))`
on sampled ones (p(x) the stored log-prob, q processed as the decoder samples it), and 0
past a trimmed drafter's cut (the slot is not proposed); an
`NgramDrafter` or `SuffixDrafter` is scored from token ids alone. Results are cached per
(drafter weights, target, rollouts, settings) (docs/methods.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm

from blockdraft.artifacts import with_filename, write_atomic
from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollouts.store import target_fingerprint
from blockdraft.decoding.proposers import proposals_per_round
from blockdraft.drafters.draft_vocab import target_to_draft
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.drafters.ngram import NgramDrafter, future_tokens
from blockdraft.drafters.suffix import SuffixDrafter
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.errors import os_error_message
from blockdraft.kernels.row_argmax import row_argmax
from blockdraft.sampling import processed_probs
from blockdraft.user_cache import cache_root

SCORING_VERSION = "3"  # part of every cache key: raised when scores may change
LOGIT_BUDGET = 1 << 24  # floats of drafter logits materialised at once (64 MB float32)


@torch.no_grad()
def acceptance_tensor(
    drafter: Any,
    target: Any,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    logprobs: torch.Tensor | None,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    anchor_chunk: int = 64,
) -> torch.Tensor:
    """`[L-1, K]` float32 acceptance probabilities of one rollout (module docstring)."""
    if isinstance(drafter, NgramDrafter | SuffixDrafter):  # deterministic: 1[x = y] from ids
        return drafter.acceptance_from_tokens(prompt_ids.reshape(-1), response_ids.reshape(-1))
    k = proposals_per_round(drafter)
    prompt_ids, response_ids = prompt_ids.long().reshape(-1), response_ids.long().reshape(-1)
    hybrid = drafter if isinstance(drafter, HybridDrafter) else None
    if hybrid is not None:  # per slot: the drafter's q, or a one-hot on the looked-up token
        drafter = hybrid.drafter
        looked_up = hybrid.ngram.proposals_from_tokens(prompt_ids, response_ids)
        lookup_hit = (looked_up == future_tokens(response_ids, k)).double()
    trimmed = drafter if isinstance(drafter, TrimmedDrafter) else None
    if trimmed is not None:  # per block: the slots before the first unconfident one
        drafter = trimmed.drafter
    P, L = prompt_ids.numel(), response_ids.numel()
    if P == 0:
        raise ValueError("rollout has an empty prompt: the first round has no context")
    if L < 2:
        return torch.zeros(0, k)
    greedy = temperature == 0
    if not greedy and (logprobs is None or logprobs.numel() != L):
        raise ValueError(
            f"sampled rollout needs one log-prob per response token ({L}), got "
            f"{None if logprobs is None else logprobs.numel()}"
        )
    if not greedy and bool(torch.isnan(logprobs).any()):
        raise ValueError(
            "rollout has no log-probs (greedy rollouts made with --no-logprobs): it can be "
            "scored greedily (temperature 0) only"
        )
    dev = target.device
    if not greedy:
        p_x = logprobs.to(dev).double().exp()
    if hybrid is not None:
        looked_up, lookup_hit = looked_up.to(dev), lookup_hit.to(dev)
    seq = torch.cat([prompt_ids, response_ids]).to(dev)
    total = seq.numel()
    features = _target_features(target, seq)
    anchors = round_start_anchors(P, L).to(dev)
    slots = torch.arange(1, k + 1, device=dev)
    # everything stays on the target's device; one copy to the host at the end
    out = torch.zeros(L - 1, k, dtype=torch.float64, device=dev)
    # scored in the drafter's own vocabulary (`compute_draft_logits`: identical argmax,
    # softmax and q(x), without expanding to the target's -inf-padded vocabulary)
    score_logits = getattr(drafter, "compute_draft_logits", None)
    draft_ids = getattr(drafter, "draft_ids", None) if score_logits is not None else None
    if score_logits is None:  # drafters without a draft-space head: target space
        score_logits = drafter.compute_logits
    to_draft = None
    if draft_ids is not None:
        draft_ids = draft_ids.to(dev)
        to_draft = target_to_draft(draft_ids, int(target.vocab_size))
    vocab = int(draft_ids.numel() if draft_ids is not None else target.vocab_size)
    rows_per_logit_chunk = max(1, LOGIT_BUDGET // max(1, k * vocab))
    for start in range(0, anchors.numel(), anchor_chunk):
        chunk = anchors[start : start + anchor_chunk]
        # [A, K, H]: one block per round start of the chunk
        hidden = drafter.forward_blocks(features, seq.unsqueeze(0), chunk.unsqueeze(0))[0]
        for s in range(0, chunk.numel(), rows_per_logit_chunk):
            a = chunk[s : s + rows_per_logit_chunk]
            idx = a[:, None] + slots[None, :]  # [A,K] index of the proposed token
            valid = idx < total
            labels = seq[idx.clamp_max(total - 1)]
            prev = seq[(idx - 1).clamp_max(total - 1)]
            logits = score_logits(hidden[s : s + a.numel()], prev)
            if greedy:
                best = row_argmax(logits)
                acc = ((best if draft_ids is None else draft_ids[best]) == labels).double()
            else:
                q = processed_probs(logits, temperature, top_p, top_k)
                col = labels if to_draft is None else to_draft[labels]
                q_x = q.gather(-1, col.clamp_min(0).unsqueeze(-1)).squeeze(-1).double()
                q_x = torch.where(col >= 0, q_x, torch.zeros_like(q_x))
                resp_idx = (idx - P).clamp(0, L - 1)
                acc = torch.clamp(q_x / p_x[resp_idx].clamp_min(1e-300), max=1.0)
            rows = a - P
            if hybrid is not None:
                lengths = (looked_up[rows] >= 0).sum(-1, keepdim=True)
                use = hybrid.use_lookup(logits, lengths).to(dev)
                acc = torch.where(use, lookup_hit[rows], acc)
            if trimmed is not None:
                acc = acc * trimmed.kept(logits).to(dev)
            out[rows] = torch.where(valid, acc, torch.zeros((), dtype=torch.float64, device=dev))
    return out.float().cpu()


# --- target features shared across drafters ----------------------------------------------
class FeatureMemo:
    """Target features of rollouts, computed once and reused while the target is unchanged
    (same target object and feature layers), up to `max_bytes` (least recently used first
    out). Why: the target forward is most of the per-rollout cost, and scoring several
    drafters (or thresholds, or training evaluations) on one set would repeat it."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes, self.held = max_bytes, 0
        self.entries: OrderedDict = OrderedDict()

    def features(self, target: Any, seq: torch.Tensor) -> torch.Tensor:
        key = (id(target), tuple(getattr(target, "layer_ids", ())), tuple(seq.tolist()))
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        features = target.forward(seq.unsqueeze(0), logits_to_keep=1).features
        size = features.numel() * features.element_size()
        while self.entries and self.held + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.held -= old.numel() * old.element_size()
        if size <= self.max_bytes:
            self.entries[key] = features
            self.held += size
        return features


_MEMO: FeatureMemo | None = None


@contextlib.contextmanager
def shared_target_features(memo: FeatureMemo | None = None) -> Iterator[FeatureMemo]:
    """Inside the block, scoring takes target features from `memo` (a new 1 GiB one by
    default): a block, not a global cache, because features are valid only while the
    target is."""
    global _MEMO
    outer, _MEMO = _MEMO, memo if memo is not None else FeatureMemo()
    try:
        yield _MEMO
    finally:
        _MEMO = outer


def _target_features(target: Any, seq: torch.Tensor) -> torch.Tensor:
    if _MEMO is None:
        return target.forward(seq.unsqueeze(0), logits_to_keep=1).features
    return _MEMO.features(target, seq)


# --- identities for the cache -------------------------------------------------------------
def tensor_state_hash(module: Any) -> str:
    """sha256 over the names and bytes of a module's state dict (its weights)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rollouts_hash(rollouts: Iterable[Any]) -> str:
    """sha256 over every rollout's prompt, response and log-probs (order matters)."""
    h = hashlib.sha256()
    for r in rollouts:
        for t in (r.prompt_ids, r.response_ids, r.logprobs):
            t = t.detach().cpu().contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _target_id(target: Any) -> str:
    try:
        return str(target_fingerprint(target))
    except Exception:  # fake targets in tests have no HF config
        return str(getattr(target, "name", type(target).__name__))


def _precision_key(drafter: Any, target: Any) -> list[str]:
    """The dtypes the target and the drafter ran in, when not float32 (`--dtype bfloat16`
    scores differ from fp32 ones by rounding, so they must not share a cache entry; fp32
    runs keep the keys they always had)."""
    inner = drafter.drafter if isinstance(drafter, HybridDrafter | TrimmedDrafter) else drafter
    dtypes = [getattr(target, "dtype", torch.float32), getattr(inner, "dtype", torch.float32)]
    if all(d == torch.float32 for d in dtypes):
        return []
    return ["dtypes=" + ",".join(str(d) for d in dtypes)]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of `tensors` (sorted by name): the
    record a cache entry carries, so a changed byte is found, not reported as a MAL."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_cache_entry(path: Path, num_rollouts: int) -> list[torch.Tensor] | None:
    """The acceptance tensors cached at `path`, or None to recompute (and overwrite) them:
    an entry is used only when it reads and matches the SHA-256 it records (a damaged one
    is recomputed with a one-line warning)."""
    try:
        if not path.is_file():
            return None
    except OSError as exc:  # an unusable cache directory: the cache is optional
        print(f"warning: {os_error_message(exc)}: acceptance cache not read", file=sys.stderr)
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            recorded = (f.metadata() or {}).get("sha256")
        stored = load_file(str(path))
        tensors = {f"r{i}": stored[f"r{i}"] for i in range(num_rollouts)}
    except Exception as exc:  # SafetensorError, a missing row: damaged
        problem = (
            f"unreadable ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
        )
    else:
        if recorded is None:
            return None  # written before entries carried a checksum: quietly made again
        if tensors_digest(tensors) == recorded and len(stored) == num_rollouts:
            return list(tensors.values())
        problem = "changed since it was written (sha256 differs)"
    print(f"warning: {path}: cached acceptance tensors {problem}; recomputing", file=sys.stderr)
    return None


def score_rollouts(
    drafter: Any,
    target: Any,
    rollouts: Sequence[Any],
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    *,
    drafter_id: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    progress: bool | str = False,
) -> list[torch.Tensor]:
    """Acceptance tensors `[L_i - 1, K]` for every rollout, from the disk cache if present.

    `progress` may be the bar's label (`scoring dpace`). `drafter_id` identifies the
    drafter's weights (`checkpoint_hash(dir)`); if None it is hashed from the state dict
    (nn.Module drafters) or caching is skipped."""
    rollouts = list(rollouts)
    if isinstance(drafter, SuffixDrafter):  # from token ids; a global tree sees set order
        pairs = [(r.prompt_ids.reshape(-1), r.response_ids.reshape(-1)) for r in rollouts]
        return drafter.acceptance_of_rollouts(pairs)
    if isinstance(drafter, NgramDrafter):
        use_cache = False  # scoring from token ids is cheaper than hashing the rollouts
    if use_cache and drafter_id is None and hasattr(drafter, "state_dict"):
        # only for the cache key: training's held-out evaluation (no cache) must not hash
        # (and copy to the host) every drafter weight at each evaluation
        drafter_id = tensor_state_hash(drafter)
    if isinstance(drafter, HybridDrafter) and drafter_id is not None:
        drafter_id = f"{drafter_id}+{drafter.ngram.name}@{drafter.min_confidence}"
    if isinstance(drafter, TrimmedDrafter) and drafter_id is not None:
        drafter_id = f"{drafter_id}+trim@{drafter.min_confidence}"
    path = None
    if use_cache and drafter_id is not None:
        key = hashlib.sha256(
            "\x00".join(
                [
                    SCORING_VERSION,
                    drafter_id,
                    _target_id(target),
                    rollouts_hash(rollouts),
                    repr((float(temperature), float(top_p), int(top_k))),
                    *_precision_key(drafter, target),
                ]
            ).encode()
        ).hexdigest()
        path = Path(cache_dir) if cache_dir is not None else cache_root() / "acceptance"
        path = path / f"{key[:32]}.safetensors"
        cached = read_cache_entry(path, len(rollouts))
        if cached is not None:
            return cached
    iterator: Iterable[Any] = rollouts
    if progress:
        desc = progress if isinstance(progress, str) else "scoring"
        iterator = tqdm(rollouts, desc=desc, unit="rollout", dynamic_ncols=True)
    out = [
        acceptance_tensor(
            drafter, target, r.prompt_ids, r.response_ids, r.logprobs, temperature, top_p, top_k
        )
        for r in iterator
    ]
    if path is not None:
        tensors = {f"r{i}": t.contiguous() for i, t in enumerate(out)}
        meta = {"drafter": drafter_id, "num_rollouts": str(len(out))}
        write_cache_entry(path, tensors, {**meta, "sha256": tensors_digest(tensors)})
    return out


def write_cache_entry(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Store computed scores in the cache, atomically (a per-process temp file, fsync,
    rename). The cache is optional: a full disk or an unusable directory is one warning
    naming the path, the temp file is removed, and the scores are still returned."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, save(tensors, metadata=meta), per_process=True)
    except OSError as exc:
        print(
            f"warning: {os_error_message(with_filename(exc, path))}: the acceptance cache "
            "was not written (the scores are used as computed)",
            file=sys.stderr,
        )


def score_rollout_set(
    drafter: Any, target: Any, rollout_set: Any, **kwargs: Any
) -> list[torch.Tensor]:
    """`score_rollouts` with the sampling settings stored in the rollout set's manifest."""
    s = rollout_set.settings
    return score_rollouts(
        drafter, target, list(rollout_set), s.temperature, s.top_p, s.top_k, **kwargs
    )
