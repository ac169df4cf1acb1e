"""One small interface for everything that proposes a block, so the loop never asks which
kind of drafter it holds.

Prompt lookup, a parallel or semi-AR block drafter, a lookup-input drafter, a hybrid
(drafter + lookup fallback) and a trimmed drafter (its confident prefix only) differ in
what they read (features or only the verified text) and in how a block is drawn;
`proposer_for` picks the adapter once, and the loop calls `start`, then `propose` /
`advance` every round. Proposals are target token ids; `q` is the distribution they were
drawn from (None: deterministic, i.e. one-hot, or T = 0).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from blockdraft.decoding.cpu.lean_drafter import LeanDrafter
from blockdraft.drafters.dflash import BlockDrafter
from blockdraft.drafters.draft_vocab import in_target_space, sample_draft_logits
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.drafters.lookup_inputs import lookup_rule
from blockdraft.drafters.ngram import NgramTable
from blockdraft.drafters.suffix import SuffixDrafter
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.kernels import cpu_kernels_apply
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from blockdraft.kernels.packed_linear import pack_weight
from blockdraft.kernels.row_argmax import row_argmax
from blockdraft.sampling import processed_probs, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] long, target ids (k <= K; prompt lookup may propose fewer)
    q: torch.Tensor | None  # [k, V] the draft distribution; None: deterministic or T = 0


class Proposer(Protocol):
    """What the decoding loop asks of a drafter (see module docstring)."""

    uses_features: bool  # does it read the target's hidden features?

    def start(self, features: torch.Tensor | None) -> None:
        """After the prefill: the features of every prompt position (None if unused)."""

    def propose(self, tokens: list[int], anchor: int, position: int) -> Proposal:
        """The block for the round whose anchor `anchor` sits at sequence index `position`;
        `tokens` is the verified text (prompt + output so far, anchor included)."""

    def advance(self, features: torch.Tensor | None, position: int) -> None:
        """After verification: the features of the verified positions `position..` (the
        anchor and the accepted proposals), which become context for the next round."""


@dataclass
class Sampling:
    """The loop's sampling settings, as the proposers need them."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def proposer_for(drafter: Any, sampling: Sampling) -> Proposer:
    """The adapter for `drafter`: a hybrid, any drafter with the inference interface of
    docs/architecture.md (`new_state`, `extend_context`, `draft_logits`/`draft_hidden`),
    or prompt lookup (anything with `propose(tokens)`)."""
    if isinstance(drafter, HybridDrafter):
        return HybridProposer(drafter, sampling)
    if isinstance(drafter, TrimmedDrafter):
        return TrimmedProposer(drafter, sampling)
    if hasattr(drafter, "new_state"):
        return BlockProposer(drafter, sampling)
    if callable(getattr(drafter, "propose", None)):
        return LookupProposer(drafter)
    raise TypeError(f"{type(drafter).__name__} is not a drafter (no new_state or propose)")


def proposals_per_round(drafter: Any) -> int:
    """K of any drafter kind."""
    cfg = getattr(drafter, "config", None)
    k = getattr(cfg, "num_proposals", None) if cfg is not None else None
    return int(k if k is not None else drafter.num_proposals)


class NgramIndex:
    """An n-gram drafter's lookup table grown with the verified text, one round at a time.

    `drafter.propose(tokens)` rebuilds the table from the whole text (O(length) per
    round); the verified text only ever grows, so the loop keeps one table and adds the
    new tokens' n-grams (O(accepted) per round). Falls back to `propose` for drafters
    without the incremental table."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        try:
            self.index = NgramTable(drafter.config)
        except (ImportError, AttributeError):
            self.index = None

    def propose(self, tokens: list[int]) -> list[int]:
        if self.index is None:
            return list(self.drafter.propose(tokens))[: proposals_per_round(self.drafter)]
        self.index.advance(tokens, len(tokens))
        return self.index.propose(tokens, len(tokens))


class LookupProposer:
    """Prompt lookup or suffix decoding: reads only the verified text; its proposals are
    deterministic. Each keeps its index (n-gram table, suffix tree) grown round by round."""

    uses_features = False

    def __init__(self, drafter: Any) -> None:
        self.index = drafter.index() if isinstance(drafter, SuffixDrafter) else NgramIndex(drafter)

    def start(self, features: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: list[int], anchor: int, position: int) -> Proposal:
        return Proposal(torch.tensor(self.index.propose(tokens), dtype=torch.long), None)

    def advance(self, features: torch.Tensor | None, position: int) -> None:
        pass


class BlockProposer:
    """A neural block drafter (parallel, semi-AR or lookup-input) and its context cache."""

    uses_features = True

    def __init__(self, drafter: Any, sampling: Sampling) -> None:
        self.drafter, self.sampling = drafter, sampling
        greedy_head = sampling.greedy and GreedyDraftHead.applies(drafter)
        self.head = GreedyDraftHead.of(drafter) if greedy_head else None
        reads_lookup = getattr(getattr(drafter, "config", None), "lookup_inputs", False)
        self.block_lookup = (
            NgramIndex(lookup_rule(proposals_per_round(drafter))) if reads_lookup else None
        )
        # DFlash2 at T = 0: its unary logits through the same fast head, then the selector
        self.selector_head = (
            GreedyDraftHead.of(drafter)
            if sampling.greedy and hasattr(drafter, "greedy_columns") and not reads_lookup
            else None
        )
        # a parallel or DFlash2 drafter at T = 0 on a CPU: context update and block in one
        # lean pass (decoding/cpu/lean_drafter.py); the context and state are then its own
        greedy = self.head is not None or self.selector_head is not None
        lean = LeanDrafter.of(drafter) if greedy and cpu_kernels_apply(_device(drafter)) else None
        self.context = lean or drafter
        self.state = self.context.new_state()

    def start(self, features: torch.Tensor | None) -> None:
        self.context.extend_context(self.state, features, 0)

    def propose(self, tokens: list[int], anchor: int, position: int) -> Proposal:
        if self.block_lookup is not None:
            self.state.lookup = self.block_lookup.propose(tokens)
        if self.head is not None:
            return Proposal(
                self.head.pick(self.context.draft_hidden(self.state, anchor, position)), None
            )
        if self.selector_head is not None:
            hidden = self.context.draft_hidden(self.state, anchor, position)
            products = self.selector_head.products(hidden)
            columns = self.drafter.greedy_columns(hidden, anchor, products)
            return Proposal(self.selector_head.target_ids(columns), None)
        s = self.sampling
        return Proposal(
            *draft_block(
                self.drafter,
                self.state,
                anchor,
                position,
                s.temperature,
                s.top_p,
                s.top_k,
                s.generator,
            )
        )

    def advance(self, features: torch.Tensor | None, position: int) -> None:
        if self.state.length > position:  # a drafter that cached beyond the verified context
            self.state.crop(position)
        self.context.extend_context(self.state, features, position)


class HybridProposer(BlockProposer):
    """A block drafter whose low-confidence slots take prompt lookup's token
    (drafters/hybrid.py); the lookup runs over the verified text every round."""

    def __init__(self, drafter: HybridDrafter, sampling: Sampling) -> None:
        super().__init__(drafter, sampling)
        self.head = None  # the merge needs the drafter's logits, not only its argmax
        self.context, self.state, self.products = _logit_round(drafter.drafter, sampling)
        # a lookup-input drafter under a fallback of the same rule: one lookup serves both
        shared = self.block_lookup is not None and (
            self.block_lookup.drafter.config == drafter.ngram.config
        )
        self.lookup = self.block_lookup if shared else NgramIndex(drafter.ngram)

    def propose(self, tokens: list[int], anchor: int, position: int) -> Proposal:
        s = self.sampling
        looked_up = self.lookup.propose(tokens)
        if self.block_lookup is not None:  # a lookup-input drafter reads its rule's lookup
            same = self.lookup is self.block_lookup
            self.state.lookup = looked_up if same else self.block_lookup.propose(tokens)
        hidden = self.context.draft_hidden(self.state, anchor, position)
        products = None if self.products is None else self.products.products(hidden)
        return Proposal(
            *self.drafter.block_from_hidden(
                hidden, looked_up, s.temperature, s.top_p, s.top_k, s.generator, products
            )
        )


class TrimmedProposer(BlockProposer):
    """A block drafter proposing only the slots before its first unconfident one
    (drafters/trimmed.py): 0..K tokens a round, as prompt lookup proposes."""

    def __init__(self, drafter: TrimmedDrafter, sampling: Sampling) -> None:
        super().__init__(drafter.drafter, sampling)
        self.trimmed = drafter
        self.head = self.selector_head = None  # the cut needs the logits, not only the argmax
        self.context, self.state, self.products = _logit_round(drafter.drafter, sampling)

    def propose(self, tokens: list[int], anchor: int, position: int) -> Proposal:
        s = self.sampling
        if self.block_lookup is not None:
            self.state.lookup = self.block_lookup.propose(tokens)
        hidden = self.context.draft_hidden(self.state, anchor, position)
        inner = self.trimmed.drafter
        if self.products is None:
            logits = inner.compute_draft_logits(hidden)  # [K, V_draft]
        else:
            logits = inner.slot_logits(hidden, None, self.products.products(hidden))
        n = int(self.trimmed.kept(logits).sum())
        ids = inner.draft_ids
        if n == 0:
            return Proposal(torch.zeros(0, dtype=torch.long, device=logits.device), None)
        if s.greedy:
            best = logits.argmax(-1)
            best = best if ids is None else ids.to(best.device)[best]
            return Proposal(best[:n], None)
        vocab = int(inner.config.vocab_size) if ids is not None else logits.shape[-1]
        drawn, q = sample_draft_logits(
            logits[:n], ids, vocab, s.temperature, s.top_p, s.top_k, s.generator
        )
        return Proposal(drawn, q)


def _logit_round(inner: Any, sampling: Sampling) -> tuple[Any, Any, GreedyDraftHead | None]:
    """(context, state, packed head or None) for a proposer that needs a trained drafter's
    logits each round: at T = 0 on a CPU its lean round and packed head."""
    greedy_cpu = (
        sampling.greedy and GreedyDraftHead.applies(inner) and cpu_kernels_apply(_device(inner))
    )
    context = (LeanDrafter.of(inner) if greedy_cpu else None) or inner
    products = GreedyDraftHead.of(inner) if greedy_cpu else None
    return context, context.new_state(), products


def _device(drafter: Any) -> torch.device:
    p = next(drafter.parameters(), None) if hasattr(drafter, "parameters") else None
    return p.device if p is not None else torch.device("cpu")


# --- drafting one block ------------------------------------------------------------------
class GreedyDraftHead:
    """T = 0 drafting for a parallel `BlockDrafter`: argmax over its own vocabulary (the
    softcap is monotonic and tokens outside a reduced draft vocabulary have -inf logits,
    so it is the token `compute_logits(...).argmax()` picks), the head's rows gathered
    once per decode instead of once per round."""

    def __init__(self, drafter: Any) -> None:
        # no reference to the drafter itself: instances are cached weakly keyed by it
        # [V_draft, H], in the dtype `BlockDrafter.base_logits` computes the logits in
        head = drafter.head_weight.detach()
        self.weight = head.to(dtype=torch.promote_types(drafter.dtype, head.dtype))
        ids = drafter.draft_ids
        self.ids = ids.to(self.weight.device) if ids is not None else None
        # K rows on a CPU: packed fp32 where the build can (cheapest), else the screen
        # (int8 or bf16) for a large head (compute-bound at K rows); plain products elsewhere
        cpu = cpu_kernels_apply(self.weight.device)
        self.packed = pack_weight(self.weight) if cpu else None
        big = (
            self.weight.dtype == torch.float32
            and self.weight.numel() >= ScreenedArgmaxHead.MIN_HEAD
        )
        self.screen = (
            ScreenedArgmaxHead(self.weight) if cpu and big and self.packed is None else None
        )

    @classmethod
    def of(cls, drafter: Any) -> GreedyDraftHead:
        """The drafter's head, reused across prompts while its weight sources are unchanged
        (tensor versions: an in-place update, e.g. `set_draft_vocab`, rebuilds it)."""
        shared = drafter.shared_head_weight
        d2t = getattr(drafter, "d2t", None)
        key = (id(shared), shared._version, None if d2t is None else (id(d2t), d2t._version))
        cached = _HEADS.get(drafter)
        if cached is None or cached[0] != key:
            cached = (key, cls(drafter))
            _HEADS[drafter] = cached
        return cached[1]

    @staticmethod
    def applies(drafter: Any) -> bool:
        """True for a parallel BlockDrafter (semi-AR and DFlash2 ones draft slot by slot)."""
        return (
            isinstance(drafter, BlockDrafter)
            and getattr(drafter, "markov_head", None) is None
            and not _is_sequential(drafter)
        )

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy proposals `[K]` (target ids) from `drafter.draft_hidden(...)` `[K, H]`."""
        hidden = hidden.to(self.weight.dtype)  # a bf16 drafter's rows: fp32 logits
        best = self.screen.argmax(hidden) if self.screen is not None else None
        return self.target_ids(row_argmax(self.products(hidden)) if best is None else best)

    def products(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's products `hidden @ W^T` `[K, V_draft]`, packed where built."""
        hidden = hidden.to(self.weight.dtype)
        if self.packed is not None:
            return self.packed(hidden)
        return torch.nn.functional.linear(hidden, self.weight)

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft columns -> target ids."""
        return columns if self.ids is None else self.ids[columns]


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_sequential(drafter: Any) -> bool:
    """True for drafters whose slot k depends on the token drafted at k-1 (semi-AR)."""
    flag = getattr(drafter, "sequential", None)
    if flag is not None:
        return bool(flag)
    cfg = getattr(drafter, "config", None)
    return getattr(cfg, "arch", "dflash") == "semi_ar"


def draft_block(
    drafter: Any,
    state: Any,
    anchor_id: int,
    anchor_position: int,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Propose K tokens -> (tokens [K], q [K,V] they were drawn from; None at T = 0).

    q is the processed drafter distribution (what lossless verification needs); at T = 0
    the argmax is all that matters, so no distribution is built."""
    greedy = temperature == 0
    ids = getattr(drafter, "draft_ids", None)
    if not _is_sequential(drafter) and ids is not None and not greedy:
        # a reduced vocabulary: process and sample its K x V_draft logits (Gemma: 8k
        # columns, not 262k of which all but 8k are -inf), then place q in target space
        hidden = drafter.draft_hidden(state, anchor_id, anchor_position)
        return sample_draft_logits(
            drafter.compute_draft_logits(hidden), ids, int(drafter.config.vocab_size),
            temperature, top_p, top_k, generator,
        )  # fmt: skip
    if not _is_sequential(drafter):
        logits = drafter.draft_logits(state, anchor_id, anchor_position)
        if greedy:
            return row_argmax(logits), None
        q = processed_probs(logits, temperature, top_p, top_k)
        return sample(q, generator), q
    # slot by slot (semi-AR, DFlash2): what does not depend on the previous token once per
    # block, then each slot's logits in the drafter's own vocabulary from the token before
    hidden = drafter.draft_hidden(state, anchor_id, anchor_position)  # [K, H]
    if greedy and hasattr(drafter, "greedy_columns"):  # DFlash2: all slots' scores at once
        columns = drafter.greedy_columns(hidden, anchor_id)
        return (columns if ids is None else ids.to(columns.device)[columns]), None
    base = drafter.base_logits(hidden)
    prev = torch.tensor([int(anchor_id)], device=hidden.device)
    tokens, qs = [], []
    for k in range(hidden.shape[0]):
        logits = drafter.slot_logits(hidden[k : k + 1], prev, base[k : k + 1])[0]
        if greedy:  # (a reduced vocabulary: its argmax mapped back to target ids)
            best = row_argmax(logits)
            tok = best if ids is None else ids.to(best.device)[best]
        else:  # drawn in the drafter's columns; q placed in target space once, below
            col, q = sample_draft_logits(
                logits[None], None, logits.shape[-1], temperature, top_p, top_k, generator
            )
            tok = col[0] if ids is None else ids.to(col.device)[col[0]]
            qs.append(q[0])
        tokens.append(tok)
        prev = tok.reshape(1).to(hidden.device)
    if not qs:
        return torch.stack(tokens), None
    q = torch.stack(qs)
    if ids is not None:
        q = in_target_space(q, ids, int(drafter.config.vocab_size))
    return torch.stack(tokens), q
