"""The objective types behind `make_objective`: one interface for the trainer.

Block objectives (`WeightedCEObjective` for uniform / decay / D-PACE, `E2EObjective`)
take per-proposal `logq [N, K]` and a mask; the rounds objective (`EDRObjective`) takes
whole-rollout acceptance and cost tensors. Each class names its parameters (`Params`, a
frozen dataclass: defaults and checks said once); the registry only names the classes
(docs/architecture.md, "Adding an objective").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from blockdraft.objectives import edr
from blockdraft.objectives.cross_entropy import weighted_cross_entropy
from blockdraft.objectives.dpace import DPACE_VARIANTS, dpace_weights
from blockdraft.objectives.e2e import (
    e2e_from_overlap,
    expected_accepted_fraction,
    overlap_with_logits,
)
from blockdraft.objectives.params import (
    ObjectiveParams,
    one_of,
    optional,
    param,
    positive_int,
    positive_number,
    unit_interval,
)
from blockdraft.objectives.schedules import decay_weights, default_decay_gamma, uniform_weights

ANCHOR_SAMPLERS = ("gradient", "occupancy", "uniform")  # edr round starts beyond max_anchors


@dataclass
class LossOutput:
    """A scalar loss, the per-position weights it used (detached, for logging), metrics."""

    loss: torch.Tensor
    weights: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _check_block_inputs(logq: torch.Tensor, mask: torch.Tensor) -> None:
    if logq.dim() != 2:
        raise ValueError(f"logq must have shape [N, K], got {tuple(logq.shape)}")
    if mask.shape != logq.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(logq.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )


def _block_metrics(logq: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Objective-independent training signals, comparable across objectives: mean NLL over
    real proposals and `surrogate_accepted`, the mean over blocks of `sum_j prod_{i<=j} q_i`
    (the unsmoothed D-PACE surrogate S, a greedy-acceptance proxy in proposals)."""
    with torch.no_grad():
        real = mask.sum()
        nll = torch.where(mask, -logq.float(), torch.zeros((), device=logq.device)).sum()
        nll = nll / real.clamp_min(1)
        fraction, count = expected_accepted_fraction(logq.float().exp(), mask)
        accepted = (fraction * count).sum() / (count > 0).sum().clamp_min(1)
        values = torch.stack([nll, accepted, real.to(nll.dtype)]).tolist()  # one device sync
    return dict(zip(("nll", "surrogate_accepted", "real_proposals"), values, strict=True))


class Objective:
    """Base class; subclasses implement `loss` (block objectives) or `rounds_loss` (EDR).

    `Params` is the subclass's parameters; `mode` ("greedy" | "sampling") says how the
    training rollouts were generated."""

    Params: ClassVar[type[ObjectiveParams]] = ObjectiveParams
    needs_target_distribution: bool = False
    is_rounds_objective: bool = False

    def __init__(self, name: str, params: ObjectiveParams, mode: str = "sampling") -> None:
        self.name, self.params, self.mode = name, params, mode

    def loss(
        self,
        logq: torch.Tensor,
        mask: torch.Tensor,
        *,
        draft_logits: torch.Tensor | None = None,
        target_probs: torch.Tensor | None = None,
        overlap: torch.Tensor | None = None,
        soft_logq: torch.Tensor | None = None,
    ) -> LossOutput:
        raise TypeError(
            f"objective {self.name!r} is a rounds objective: call rounds_loss, not loss"
        )

    def rounds_loss(
        self,
        acceptance: Sequence[torch.Tensor],
        cost: Sequence[torch.Tensor],
        inclusion_weights: Sequence[torch.Tensor | None] | None = None,
    ) -> LossOutput:
        raise TypeError(f"objective {self.name!r} is a block objective: call loss, not rounds_loss")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.params!r})"


@dataclass(frozen=True)
class CrossEntropyParams(ObjectiveParams):
    # lambda: the share of the target's stored top-k distribution (rollouts written with
    # --store-topk) in each slot's cross-entropy; 0 = hard labels
    soft_target_weight: float = param(0.0, unit_interval)


class WeightedCEObjective(Objective):
    """`sum sg(w) (-log q) / sum sg(w)` with weights from `weights(logq, mask) -> [N,K]`
    (uniform here; decay and D-PACE below).

    With `soft_target_weight` lambda > 0 each slot's `log q` becomes `(1 - lambda) log
    q(label) + lambda soft_logq`, `soft_logq = sum_j p(j) log q(j)` over the target's
    stored top-k (a soft target: more signal per rollout for a data-starved drafter); the
    weights stay those of the hard label, the quantity D-PACE's surrogate is made of.
    """

    Params = CrossEntropyParams

    def weights(self, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return uniform_weights(logq.shape[-1], dtype=logq.dtype, device=logq.device)

    def loss(
        self, logq, mask, *, draft_logits=None, target_probs=None, overlap=None, soft_logq=None
    ) -> LossOutput:
        _check_block_inputs(logq, mask)
        weights = self.weights(logq.detach(), mask)
        weights = torch.where(
            mask,
            weights.expand_as(logq).to(logq.dtype),
            torch.zeros((), dtype=logq.dtype, device=logq.device),
        )
        lam = self.params.soft_target_weight
        scored = logq
        if lam > 0:
            if soft_logq is None or soft_logq.shape != logq.shape:
                raise ValueError(
                    f"soft_target_weight {lam} needs soft_logq of shape {tuple(logq.shape)}, got "
                    f"{None if soft_logq is None else tuple(soft_logq.shape)}"
                )
            scored = (1 - lam) * logq + lam * soft_logq
        loss = weighted_cross_entropy(scored, weights, mask)
        metrics = _block_metrics(logq, mask)
        metrics["weight_sum"] = float(weights.sum())
        return LossOutput(loss=loss, weights=weights.detach(), metrics=metrics)


@dataclass(frozen=True)
class DecayParams(CrossEntropyParams):
    # w_j = exp(-(j-1)/gamma); null = DFlash's default for the block size (from K at loss time)
    gamma: float | None = param(None, optional(positive_number))


class DecayObjective(WeightedCEObjective):
    Params = DecayParams

    def weights(self, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k = logq.shape[-1]
        gamma = self.params.gamma
        g = default_decay_gamma(k + 1) if gamma is None else gamma
        return decay_weights(k, g, dtype=logq.dtype, device=logq.device)


@dataclass(frozen=True)
class DPaceParams(CrossEntropyParams):
    alpha: float = param(0.5, unit_interval)  # weight smoothing q~ = (1 - alpha) q + alpha
    variant: str = param("full", one_of(*DPACE_VARIANTS))  # docs/methods.md, "D-PACE"


class DPaceObjective(WeightedCEObjective):
    Params = DPaceParams

    def weights(self, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p = self.params
        return dpace_weights(logq.exp(), alpha=p.alpha, variant=p.variant, mask=mask)


@dataclass(frozen=True)
class GreedyRelaxationParams(ObjectiveParams):
    # greedy rollouts: the drafter temperature beta of the relaxation A = softmax(z / beta)(x),
    # the argmax acceptance as beta -> 0 (docs/methods.md, "EDR"); 0.5 chosen on validation
    # rollouts, 1.0 is A = q(x)
    greedy_temperature: float = param(0.5, positive_number)


@dataclass(frozen=True)
class E2EParams(GreedyRelaxationParams):
    chunk_rows: int | None = param(None, optional(positive_int))  # null: ~64 MB chunks


class E2EObjective(Objective):
    """Block-local expected accepted length from full target and drafter distributions."""

    Params = E2EParams
    needs_target_distribution = True

    def loss(
        self, logq, mask, *, draft_logits=None, target_probs=None, overlap=None, soft_logq=None
    ) -> LossOutput:
        """`overlap` [N,K] (differentiable `sum_v min(p, q)`) may replace the two full
        distributions; for a greedy target it is just `q(x)`, which avoids `[N,K,V]`."""
        _check_block_inputs(logq, mask)
        if overlap is not None:
            if overlap.shape != logq.shape:
                raise ValueError(
                    f"overlap {tuple(overlap.shape)} does not match logq {tuple(logq.shape)}"
                )
            alpha = overlap
        elif draft_logits is None or target_probs is None:
            raise ValueError(
                "objective 'e2e' needs overlap, or draft_logits and target_probs ([N, K, V] each)"
            )
        elif draft_logits.shape[:2] != logq.shape:
            raise ValueError(
                f"draft_logits {tuple(draft_logits.shape)} do not match logq {tuple(logq.shape)}"
            )
        else:
            alpha = overlap_with_logits(target_probs, draft_logits, self.params.chunk_rows)
        loss = e2e_from_overlap(alpha, mask)
        metrics = _block_metrics(logq, mask)
        with torch.no_grad():
            real = mask.sum().clamp_min(1)
            metrics["mean_overlap"] = float(
                torch.where(mask, alpha, torch.zeros_like(alpha)).sum() / real
            )
        return LossOutput(loss=loss, weights=None, metrics=metrics)


@dataclass(frozen=True)
class EDRParams(GreedyRelaxationParams):
    max_anchors: int = param(512, positive_int)  # round starts with gradient per rollout
    # how round starts beyond max_anchors are drawn (docs/training.md): PPS on each one's
    # estimated gradient norm or occupancy after a no-grad pass, or uniform (cheaper steps,
    # far more gradient noise)
    anchor_sampler: str = param("gradient", one_of(*ANCHOR_SAMPLERS))


class EDRObjective(Objective):
    """Expected decoding rounds (docs/methods.md, "EDR") over whole rollouts.

    `rounds_loss` pads the rollouts into one batch and calls the batched
    `blockdraft.objectives.edr.edr_surrogate` once (edr is imported when first used, so
    this registry imports without it). Its value is the exact expected number of rounds
    J (a Horvitz-Thompson estimate of it with anchor sub-sampling) and its gradient the
    TD-form gradient. Normalisation: the summed J of all rollouts is divided by the
    number of tokens emitted by drafting rounds, `sum_i (L_i - 1)` (x_1 comes from the
    prefill), so the loss is expected rounds per emitted token (= 1 / MAL of the batch)
    and does not scale with batch size or rollout length; longer rollouts weigh more, as
    in the MAL definition (tokens over rounds, pooled).

    `mode` "greedy" is the smooth relaxation `A = softmax(z / beta)(x_t)` for T=0 targets
    (beta = `greedy_temperature`; 1 gives `A = q(x_t)`), i.e. edr's `"greedy_soft"` at
    temperature beta (its hard indicator has no gradient); `edr_mode` holds the name to
    pass to `edr.acceptance_and_cost`, which `self.acceptance_and_cost` does for you.
    """

    Params = EDRParams
    is_rounds_objective = True

    def __init__(self, name: str, params: EDRParams, mode: str = "sampling") -> None:
        super().__init__(name, params, mode)
        self.max_anchors, self.anchor_sampler = params.max_anchors, params.anchor_sampler
        self.greedy_temperature = params.greedy_temperature
        self.edr_mode: str = "sampling" if mode == "sampling" else "greedy_soft"
        self.needs_target_distribution = mode == "sampling"

    def acceptance_and_cost(
        self,
        draft_logits: torch.Tensor,
        target: torch.Tensor | None,
        target_ids: torch.Tensor,
        **kwargs: Any,
    ):
        """`edr.acceptance_and_cost` with this objective's mode (other options passed on;
        greedy: `temperature` defaults to `greedy_temperature`)."""
        if self.edr_mode == "greedy_soft":
            kwargs.setdefault("temperature", self.greedy_temperature)
        return edr.acceptance_and_cost(
            draft_logits, target, target_ids, mode=self.edr_mode, **kwargs
        )

    def sample_round_starts(
        self, round_start_occupancy: torch.Tensor, generator: torch.Generator | None = None
    ):
        """`edr.sample_round_starts` with this objective's `max_anchors`."""
        return edr.sample_round_starts(round_start_occupancy, self.max_anchors, generator)

    def rounds_loss(self, acceptance, cost, inclusion_weights=None) -> LossOutput:
        acceptance, cost = list(acceptance), list(cost)
        if not acceptance:
            raise ValueError("rounds_loss needs at least one rollout")
        if len(cost) != len(acceptance):
            raise ValueError(
                f"got {len(acceptance)} acceptance tensors but {len(cost)} cost tensors"
            )
        if inclusion_weights is not None and len(inclusion_weights) != len(acceptance):
            raise ValueError(
                f"got {len(acceptance)} rollouts but "
                f"{len(inclusion_weights)} inclusion weight entries"
            )
        for i, (acc, cst) in enumerate(zip(acceptance, cost, strict=True)):
            if acc.dim() != 2 or acc.shape != cst.shape:
                raise ValueError(
                    f"rollout {i}: acceptance {tuple(acc.shape)} and cost {tuple(cst.shape)} "
                    "must both be [L-1, K]"
                )
        acc_batch, lengths = edr.pad_rollouts(acceptance)
        cost_batch, _ = edr.pad_rollouts(cost)
        row_weights = None
        if inclusion_weights is not None and any(w is not None for w in inclusion_weights):
            # Rollouts without weights use all their rows (weight 1); padding rows get 0.
            row_weights = acc_batch.new_zeros(acc_batch.shape[:2]).detach()
            for i, (acc, w) in enumerate(zip(acceptance, inclusion_weights, strict=True)):
                rows = acc.shape[0]
                if w is not None and tuple(w.shape) != (rows,):
                    raise ValueError(
                        f"rollout {i}: inclusion weights must have shape ({rows},), "
                        f"got {tuple(w.shape)}"
                    )
                row_weights[i, :rows] = 1.0 if w is None else w.detach().to(row_weights.dtype)
        total = edr.edr_surrogate(
            acc_batch, cost_batch, lengths=lengths, reduction="sum", row_weights=row_weights
        )
        tokens = sum(acc.shape[0] for acc in acceptance)
        loss = total / max(tokens, 1)
        rounds = float(total.detach())
        metrics = {
            "tokens": float(tokens),
            "rollouts": float(len(acceptance)),
            "expected_rounds": rounds,
            "mal": tokens / rounds if rounds > 0 else float("nan"),
        }
        return LossOutput(loss=loss, weights=None, metrics=metrics)
