"""Per-proposal acceptance probability A and immediate cost c (METHODS.md §2).

Inputs are per block: for N round starts, `draft_logits [N, K, V]` (proposal h of the
round starting at n predicts x_{n+h}), the target's distribution for the same positions
`[N, K, V]` (row h-1 = p_{n+h}(. | x_{<n+h}), the rollout prefix) and the realised
tokens `target_ids [N, K]` = x_{n+h}. Any leading shape works as long as the three agree.
Outputs `(A, c)` have the shape of `target_ids`; everything is computed in >= float32.

Modes:
- `"sampling"` (lossless speculative sampling, T > 0): `A = min(1, q(x)/p(x))`, which is
  P(proposal accepted | the verified output at that position is x). Cost (default
  `cost_form="tv"`, Rao-Blackwellised): `c = sum_{v not in S} [p(v) - q(v)]_+ /
  sum_{v not in S} p(v)`, the rejection probability averaged over the output token
  *given that it is not a stop token*. Why the conditioning: the cost of position t only
  counts when t < L, i.e. when x_t is not a stop token, so this is E[1 - A | x_{<t},
  x_t not in S]; multiplied by P(x_t not in S) it gives E[(1 - A) 1[t < L] | x_{<t}], so
  the objective keeps the expectation of the realised form while dropping the variance
  of x_t. `cost_form="realised"` gives `c = 1 - A`.
- `"greedy_hard"` (evaluation of an argmax drafter against a greedy target):
  `A = 1[argmax q = x]`, `c = 1 - A` (not differentiable).
- `"greedy_soft"` ("greedy EDR" training): `A = q(x)`, `c = 1 - A`, the exact acceptance
  of a drafter that *samples* from q against a greedy target.
(A bare `"greedy"` is rejected on purpose: the two greedy forms serve different uses.)

Stop tokens: at a realised stop token the cost is 0 in every mode, because emitting it
ends the generation and no further round can start. (The recursions ignore the cost of
the last position anyway; this keeps c meaningful for callers that look at it directly.)
The acceptance at a stop token is kept as is: whether the drafter proposed EOS matters
for the per-proposal statistics of the evaluator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockdraft.objectives.edr_fused import fused_sampling_acceptance
from blockdraft.objectives.row_chunks import by_row_chunks, check_chunk_rows, fused_chunk_rows

Tensor = torch.Tensor
MODES = ("sampling", "greedy_hard", "greedy_soft")
COST_FORMS = ("tv", "realised")


def _check(draft_logits: Tensor, target: Tensor | None, target_ids: Tensor, mode: str) -> None:
    if mode not in MODES:
        hint = (
            " ('greedy' is ambiguous: pick greedy_hard or greedy_soft)" if mode == "greedy" else ""
        )
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}{hint}")
    if draft_logits.dim() < 2:
        raise ValueError(f"draft_logits must be [..., K, V], got shape {tuple(draft_logits.shape)}")
    if target_ids.shape != draft_logits.shape[:-1]:
        raise ValueError(
            f"target_ids {tuple(target_ids.shape)} must match draft_logits "
            f"{tuple(draft_logits.shape)} without V"
        )
    if (
        target_ids.dtype.is_floating_point
        or target_ids.dtype.is_complex
        or target_ids.dtype == torch.bool
    ):
        raise ValueError(f"target_ids must be integer token ids, got dtype {target_ids.dtype}")
    vocab = draft_logits.shape[-1]
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab):
        raise ValueError(
            f"target_ids must lie in [0, {vocab}), "
            f"got range [{int(target_ids.min())}, {int(target_ids.max())}]"
        )
    if mode == "sampling":
        if target is None:
            raise ValueError("sampling mode needs the target distribution (logits or probs)")
        if target.shape != draft_logits.shape:
            raise ValueError(
                f"target {tuple(target.shape)} must match draft_logits {tuple(draft_logits.shape)}"
            )


def _stop_mask(target_ids: Tensor, stop_token_ids: Sequence[int]) -> Tensor:
    stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=target_ids.device)
    if stops.numel() == 0:
        return torch.zeros_like(target_ids, dtype=torch.bool)
    return torch.isin(target_ids.long(), stops)


def acceptance_and_cost(
    draft_logits: Tensor,
    target: Tensor | None,
    target_ids: Tensor,
    *,
    mode: str = "sampling",
    temperature: float = 1.0,
    target_is_probs: bool = False,
    stop_token_ids: Sequence[int] = (),
    cost_form: str = "tv",
    chunk_rows: int | None = None,
    fused: bool = True,
) -> tuple[Tensor, Tensor]:
    """Acceptance `A` and immediate cost `c` for each proposal (module docstring).

    Computed `chunk_rows` proposals at a time (`row_chunks`: None = ~64 MB of float32 per
    chunk), so no full `[..., V]` float32 intermediate exists and autograd keeps none;
    the same values and gradients as one pass.

    `fused` (sampling mode, target without gradient): `edr_fused`'s single pass with a
    closed-form backward instead of autograd through the formula below; same values and
    gradients up to rounding, fewer `[.., V]` passes. `fused=False` runs the
    straightforward formula (`_RowsFn`), the reference the tests compare against.

    `temperature` divides the draft logits (the drafter's sampling distribution) and, if
    `target` is given as logits, the target logits too; pass `target_is_probs=True` with
    already processed target probabilities (top-k/top-p etc.). `target` may be None in
    the greedy modes. Gradients flow into `draft_logits` (and into `target` if it
    requires grad)."""
    _check(draft_logits, target, target_ids, mode)
    if cost_form not in COST_FORMS:
        raise ValueError(f"cost_form must be one of {', '.join(COST_FORMS)}, got {cost_form!r}")
    if mode != "greedy_hard" and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for mode {mode!r}, got {temperature!r}")
    stop_token_ids = [int(s) for s in stop_token_ids]
    bad = [s for s in stop_token_ids if not 0 <= s < draft_logits.shape[-1]]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad} are outside the vocabulary [0, {draft_logits.shape[-1]})"
        )
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    stop = _stop_mask(target_ids, stop_token_ids)
    zero = torch.zeros((), dtype=dtype, device=draft_logits.device)

    if mode == "greedy_hard":
        acc = (draft_logits.argmax(-1) == target_ids.long()).to(dtype)
        return acc, torch.where(stop, zero, 1 - acc)

    vocab = draft_logits.shape[-1]
    keep = None
    if stop_token_ids and mode == "sampling" and cost_form == "tv":
        keep = torch.ones(vocab, dtype=torch.bool, device=draft_logits.device)
        keep[torch.as_tensor(stop_token_ids, dtype=torch.long, device=keep.device)] = False
    rows = check_chunk_rows(chunk_rows, vocab)
    fused_rows = fused_chunk_rows(chunk_rows, vocab, draft_logits.device)
    flat_target = target.reshape(-1, vocab) if mode == "sampling" and target is not None else None
    flat = [draft_logits.reshape(-1, vocab), flat_target, target_ids.reshape(-1).long()]
    if (
        fused
        and mode == "sampling"
        and flat_target is not None
        and not (torch.is_grad_enabled() and flat_target.requires_grad)
    ):
        stops = None
        if keep is not None:
            stops = torch.as_tensor(stop_token_ids, dtype=torch.long, device=keep.device)
        outs = fused_sampling_acceptance(
            flat[0],
            flat_target,
            flat[2],
            temperature=temperature,
            target_is_probs=target_is_probs,
            stops=stops,
            want_cost=cost_form == "tv",
            chunk_rows=fused_rows,
        )
    else:
        rows_fn = _RowsFn(mode, dtype, temperature, target_is_probs, cost_form, keep)
        outs = by_row_chunks(rows_fn, flat, rows)
    outs = tuple(o.reshape(target_ids.shape) for o in outs)
    if mode == "greedy_soft":
        return greedy_soft_from_logprobs(outs[0], target_ids, stop_token_ids)
    acc = outs[0]
    if cost_form == "realised":
        return acc, torch.where(stop, zero, 1 - acc)
    return acc, torch.where(stop, zero, outs[1].clamp(max=1.0))


class _RowsFn:
    """The per-row maths of `acceptance_and_cost` on `[rows, V]` chunks (`row_chunks`):
    greedy_soft -> `log q(x)`; sampling -> `A` (and the TV cost unless realised)."""

    def __init__(
        self,
        mode: str,
        dtype: torch.dtype,
        temperature: float,
        target_is_probs: bool,
        cost_form: str,
        keep: Tensor | None,
    ) -> None:
        self.mode, self.dtype, self.temperature = mode, dtype, temperature
        self.target_is_probs, self.cost_form, self.keep = target_is_probs, cost_form, keep

    def __call__(
        self, logits: Tensor, target: Tensor | None, ids: Tensor
    ) -> Tensor | tuple[Tensor, ...]:
        dtype, idx = self.dtype, ids.unsqueeze(-1)
        logq = torch.log_softmax(logits.to(dtype) / self.temperature, dim=-1)
        logq_x = logq.gather(-1, idx).squeeze(-1)
        if self.mode == "greedy_soft":
            return logq_x
        assert target is not None
        if self.target_is_probs:
            p = target.to(dtype)
            logp_x = p.gather(-1, idx).squeeze(-1).clamp_min(torch.finfo(dtype).tiny).log()
        else:
            logp = torch.log_softmax(target.to(dtype) / self.temperature, dim=-1)
            p = logp.exp()
            logp_x = logp.gather(-1, idx).squeeze(-1)
        # min(1, q/p) in log space; p(x) = 0 cannot happen for a token sampled from p.
        acc = torch.exp(torch.clamp(logq_x - logp_x, max=0.0))
        if self.cost_form == "realised":
            return (acc,)
        gap = (p - logq.exp()).clamp_min(0)
        mass = p
        if self.keep is not None:
            gap, mass = gap * self.keep, p * self.keep
        return acc, gap.sum(-1) / mass.sum(-1).clamp_min(torch.finfo(dtype).tiny)


def greedy_soft_from_logprobs(
    logq_x: Tensor, target_ids: Tensor, stop_token_ids: Sequence[int] = ()
) -> tuple[Tensor, Tensor]:
    """Greedy-soft `A = q(x)`, `c = 1 - A` (0 at stop tokens) from `log q(x)` alone.

    Why: against a greedy target only the drafter's probability of the realised token
    matters, so callers that already have `log q(x)` (e.g. from a vocabulary-chunked
    cross-entropy) need not materialise `[..., K, V]` logits, which at a 262k vocabulary
    is gigabytes per batch.
    """
    acc = logq_x.exp()
    stop = _stop_mask(target_ids, stop_token_ids)
    return acc, torch.where(stop, torch.zeros((), dtype=acc.dtype, device=acc.device), 1 - acc)
