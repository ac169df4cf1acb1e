"""Verification rules for one speculative round: pure tensor code, no models.

Each verifier takes the K proposals, the drafter distributions `q [K, V]` they were drawn
from and the target distributions `p [K+1, V]` (row K is the bonus position), and returns
how many proposals it accepts plus one more token, so a round always emits `accepted + 1`
tokens: `verify_greedy`, `verify_standard` (lossless speculative sampling),
`verify_onehot` (the same for deterministic proposals) and `verify_block` (Sun et al.
2024, also lossless, never shorter on average). The acceptance probabilities are public
because the exact-enumeration tests need the very functions the verifiers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.sampling import sample, uniform


@dataclass(frozen=True)
class Verdict:
    """Outcome of one round: `accepted` proposals (0..K) and the extra `token`."""

    accepted: int
    token: int


def _check(proposals: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> int:
    k = proposals.shape[0]
    if p.shape[0] != k + 1:
        raise ValueError(f"target distributions need K+1={k + 1} rows, got {p.shape[0]}")
    if q is not None and q.shape != (k, p.shape[-1]):
        raise ValueError(f"draft distributions must be [{k},{p.shape[-1]}], got {list(q.shape)}")
    return k


def verify_greedy(proposals: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy rule: accept while `proposal_k == argmax target_logits[k-1]`.

    `target_logits [K+1, V]` may be raw logits or any distribution with the same argmax.
    """
    k = _check(proposals, None, target_logits)
    best = target_logits.argmax(dim=-1)
    wrong = (proposals != best[:k]).nonzero()
    m = int(wrong[0, 0]) if wrong.numel() else k
    return Verdict(m, int(best[m]))


def _ratio(proposals: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Unclamped `p_k(y_k) / q_k(y_k)` -> `[K]`.

    `q(y) = 0` cannot happen for a token drawn from q; it is mapped to "accept iff p(y) > 0".
    """
    k = _check(proposals, q, p)
    idx = proposals.long().unsqueeze(-1)
    py = p[:k].gather(-1, idx).squeeze(-1)
    qy = q.gather(-1, idx).squeeze(-1)
    inf_or_zero = torch.where(py > 0, torch.inf, 0.0).to(py.dtype)
    return torch.where(qy > 0, py / qy.clamp_min(torch.finfo(qy.dtype).tiny), inf_or_zero)


def standard_accept_probs(
    proposals: torch.Tensor, q: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """`min(1, p_k(y_k) / q_k(y_k))` for k = 1..K -> `[K]`."""
    return _ratio(proposals, q, p).clamp(max=1.0)


def _residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """`norm([p - q]_+)`; falls back to `p` when the residual has no mass (p == q)."""
    r = (p_row - q_row).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p_row


def verify_standard(
    proposals: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Lossless token-by-token speculative sampling; consumes K uniforms + 1 sample."""
    k = _check(proposals, q, p)
    accept = standard_accept_probs(proposals, q, p)
    u = uniform((k,), generator, accept.dtype, accept.device)
    rejected = (u >= accept).nonzero()
    if rejected.numel() == 0:
        return Verdict(k, int(sample(p[k], generator)))
    m = int(rejected[0, 0])
    return Verdict(m, int(sample(_residual(p[m], q[m]), generator)))


def verify_onehot(
    proposals: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """`verify_standard` for deterministic proposals (q one-hot on `y`), without building q.

    Accept `y_k` with prob `min(1, p_k(y_k) / 1) = p_k(y_k)`; on rejection sample from
    `norm([p_k - onehot(y_k)]_+)` = p_k without y_k, renormalised; bonus from `p_K`.
    Same arithmetic and the same random draws as `verify_standard(y, onehot(y), p)`, so
    the two return identical verdicts for the same generator state (tested); this is
    what the n-gram (prompt lookup) drafter uses at T > 0. K = 0 (no proposal) samples
    the round's one token from `p_0`.
    """
    k = _check(proposals, None, p)
    idx = proposals.long()
    accept = p[:k].gather(-1, idx.unsqueeze(-1)).squeeze(-1).clamp(max=1.0)
    u = uniform((k,), generator, accept.dtype, accept.device)
    rejected = (u >= accept).nonzero()
    if rejected.numel() == 0:
        return Verdict(k, int(sample(p[k], generator)))
    m = int(rejected[0, 0])
    residual = p[m].clone()
    residual[idx[m]] = 0
    total = residual.sum()
    return Verdict(m, int(sample(residual / total if total > 0 else p[m], generator)))


def block_weights(proposals: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Block verification's running weights `p_0..p_K` -> `[K+1]` (`p_0 = 1`).

    `p_i = min(1, p_{i-1} * p_i(y_i) / q_i(y_i))`: how much of the target's mass on the
    prefix `y_1..y_i` the draft has not yet "used up".
    """
    raw = _ratio(proposals, q, p)
    k = proposals.shape[0]
    weights = [torch.ones((), dtype=p.dtype)]
    for i in range(k):
        nxt = torch.nan_to_num(weights[-1] * raw[i], nan=0.0)  # 0 * inf: prefix impossible
        weights.append(nxt.clamp(max=1.0))
    return torch.stack(weights)


def block_residual(weight: torch.Tensor, p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual `[w * p - q]_+` at a stopping point (Sun et al., Alg. 2)."""
    return (weight * p_row - q_row).clamp_min(0)


def block_stop_probs(proposals: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`h_1..h_K` -> `[K]`: the chance to stop at i given no longer prefix was kept.

    `h_i = r_i / (r_i + 1 - w_i)` with `r_i = sum [w_i p_{i+1} - q_{i+1}]_+` for i < K,
    `h_K = w_K`. The accepted length is `max{i : eta_i <= h_i}` (0 if none) with
    independent uniforms `eta_i`.
    """
    k = _check(proposals, q, p)
    w = block_weights(proposals, q, p)
    h = torch.empty(k, dtype=p.dtype)
    for i in range(1, k):
        r = block_residual(w[i], p[i], q[i]).sum()
        denom = r + 1 - w[i]
        h[i - 1] = r / denom if denom > 0 else torch.zeros((), dtype=p.dtype)
    h[k - 1] = w[k]
    return h.clamp(0.0, 1.0)


def verify_block(
    proposals: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Lossless block verification: keep the longest prefix i with `eta_i <= h_i`."""
    k = _check(proposals, q, p)
    h = block_stop_probs(proposals, q, p)
    eta = uniform((k,), generator, h.dtype, h.device)
    kept = (eta <= h).nonzero()
    m = int(kept[-1, 0]) + 1 if kept.numel() else 0
    if m == k:
        return Verdict(k, int(sample(p[k], generator)))
    w = block_weights(proposals, q, p)
    r = block_residual(w[m], p[m], q[m])
    dist = r / r.sum() if r.sum() > 0 else p[m]
    return Verdict(m, int(sample(dist, generator)))
