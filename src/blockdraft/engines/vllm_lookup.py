"""vLLM's DFlash proposer made lookup-aware: how the plugin serves `blockdraft.serving`.

Why: vLLM's `DFlashProposer` writes `[anchor, MASK x K]` per request and drafts the
argmax. A `lookup_inputs` export needs the K slots to read `lookup_rule(K)`'s proposal over
the request's verified tokens (prompt, output so far and the token just sampled, which is
the anchor): the inputs `lookup_block_inputs` gives the drafter in training and scoring.
A `hybrid` export needs each slot whose max probability, over the drafter's own (draft)
vocabulary as the evaluator computes it, is below `conf` to take the looked-up token where
lookup has one (`HybridDrafter.use_lookup`). A `trim` export proposes each request only
the slots before its first one below `conf` (`TrimmedDrafter.kept`): vLLM's DFlash
proposer drafts K for every request, so the runner's draft token ids are cut to each
request's length before the scheduler reads them (as variable-length lists, the form its
`ngram` proposer hands over). All change only what is proposed, so vLLM's verification
stays lossless.

Where the verified tokens are: vLLM drafts before its bookkeeping (the padded drafter
batch, the only mode DFlash runs in), so request i's verified text is
`input_batch.token_ids_cpu[i, :num_tokens_no_spec[i]]` followed by this step's valid
sampled tokens. The runner's `propose_draft_token_ids` hands them to the proposer, and
every step checks that each text ends in the anchor vLLM drafts from, so a vLLM that
orders its batch otherwise fails loudly instead of drafting from the wrong text.
Asynchronous scheduling leaves placeholders in `token_ids_cpu`: it is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from blockdraft.drafters.draft_vocab import draft_ids_from_d2t
from blockdraft.drafters.ngram import NgramConfig, NgramTable
from blockdraft.drafters.trimmed import slot_confidence
from blockdraft.serialization.serving_rules import ServingRules

PLACEHOLDER = -1  # vLLM's id for a rejected position in the sampled-token rows


class RequestLookups:
    """One lookup rule over many requests' texts, each request's n-gram table grown with
    its text (new tokens only per step); tables of requests no longer in the batch go."""

    def __init__(self, rule: NgramConfig) -> None:
        self.rule = rule
        self.tables: dict[Any, NgramTable] = {}

    def propose(self, request_ids: Sequence[Any], texts: Sequence[list[int]]) -> list[list[int]]:
        """Up to K looked-up tokens per request (`NgramDrafter.propose` on its text)."""
        kept, out = {}, []
        for rid, text in zip(request_ids, texts, strict=True):
            table = self.tables.get(rid)
            if table is None or table.done > max(len(text) - 1, 0):
                table = NgramTable(self.rule)  # new, or a text that shrank: start again
            table.advance(text, len(text))
            out.append(table.propose(text, len(text)))
            kept[rid] = table
        self.tables = kept
        return out


def verified_texts(input_batch: Any, sampled: Any, discarded: Any = None) -> list[list[int]]:
    """Each request's verified tokens when vLLM drafts: its stored tokens plus this step's
    valid sampled ones (a tensor before bookkeeping; a list once bookkeeping stored them).
    `discarded[i]`: request i sampled nothing this step (a partial prefill)."""
    rows = sampled.tolist() if isinstance(sampled, torch.Tensor) else None
    vocab = int(input_batch.vocab_size)
    texts = []
    for i in range(int(input_batch.num_reqs)):
        text = input_batch.token_ids_cpu[i, : int(input_batch.num_tokens_no_spec[i])].tolist()
        if rows is not None and not (discarded is not None and bool(discarded[i])):
            text += [t for t in rows[i] if t != PLACEHOLDER and 0 <= t < vocab]
        texts.append(text)
    return texts


def merge_hybrid(
    tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    looked_up: Sequence[list[int]],
    conf: float,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hybrid`'s per-slot choice on a batch: tokens `[B*K]` (request-major), the
    drafter's logits `[B*K, D]` in its own vocabulary, each request's lookup (0..K
    tokens). A slot takes the looked-up token where the softmax's maximum is < `conf` and
    lookup has a token there; `probs` rows `[B*K, V]` of such slots become one-hot."""
    B = len(looked_up)
    K = tokens.numel() // max(B, 1)
    lookup = torch.full((B, K), -1, dtype=torch.long)
    for b, row in enumerate(looked_up):
        if row:
            lookup[b, : min(len(row), K)] = torch.tensor(row[:K])
    lookup = lookup.to(tokens.device)
    confidence = slot_confidence(draft_logits).view(B, K)
    slots = torch.arange(K, device=tokens.device)
    use = ((confidence < conf) & (slots < (lookup >= 0).sum(-1, keepdim=True))).view(-1)
    merged = torch.where(use, lookup.view(-1).to(tokens.dtype), tokens.view(-1))
    if probs is not None:
        one_hot = torch.zeros_like(probs).scatter_(-1, merged.long().view(-1, 1), 1.0)
        probs = torch.where(use.view(-1, 1), one_hot, probs)
    return merged.view_as(tokens), probs


def trimmed_lengths(draft_logits: torch.Tensor, num_requests: int, conf: float) -> list[int]:
    """`trim`'s block length per request: the drafter's logits `[B*K, D]` (request-major,
    its own vocabulary); each request keeps the slots before its first below `conf`."""
    confident = slot_confidence(draft_logits).view(num_requests, -1) >= conf
    return confident.long().cumprod(-1).sum(-1).tolist()


def draft_argmax_in_target_ids(
    draft_logits: torch.Tensor, draft_id_to_target_id: torch.Tensor | None
) -> torch.Tensor:
    """The target ids of the drafter's argmax over its own vocabulary: what vLLM's
    `compute_logits(...).argmax(-1)` gives, whose logits put draft id i at target id
    `i + draft_id_to_target_id[i]` and -inf elsewhere."""
    ids = draft_logits.argmax(dim=-1)
    if draft_id_to_target_id is None:
        return ids
    return draft_ids_from_d2t(draft_id_to_target_id.to(ids.device))[ids]


def trim_drafts(draft_token_ids: Any, lengths: list[int]) -> list[list[int]]:
    """The runner's draft token ids `[B, K]` cut to each request's length."""
    rows = draft_token_ids.tolist()
    if len(rows) != len(lengths):
        raise RuntimeError(
            f"blockdraft's trimmed DFlash: vLLM drafted for {len(rows)} requests but the "
            f"proposer cut {len(lengths)} blocks (a vLLM other than 0.32 drafts otherwise)"
        )
    return [row[:n] for row, n in zip(rows, lengths, strict=True)]


def serving_of(hf_config: Any) -> ServingRules | None:
    """The `blockdraft.serving` section vLLM's draft config carries (None: a plain drafter)."""
    return ServingRules.read(getattr(hf_config, "blockdraft", None), "the draft model config")


@functools.cache
def _lookup_proposer_class() -> type:
    """`DFlashProposer` with the lookups, built once (vLLM is imported on demand)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer  # lazy: vLLM is an optional extra

    class LookupDFlashProposer(DFlashProposer):
        """vLLM's DFlash proposer, its block inputs and draft merged with prompt lookup."""

        def start_lookups(self, serving: ServingRules) -> None:
            self.serving = serving
            self.verified: list[list[int]] | None = None
            self.request_ids: list[Any] = []
            self.input_lookups = RequestLookups(serving.inputs) if serving.inputs else None
            self.hybrid_lookups = (
                RequestLookups(serving.hybrid_lookup) if serving.hybrid_lookup else None
            )
            self.hybrid_proposals: list[list[int]] | None = None
            self.trimmed: list[int] | None = None

        def take_verified(self, request_ids: list[Any], texts: list[list[int]]) -> None:
            self.request_ids, self.verified = request_ids, texts

        def set_inputs_first_pass(self, **kwargs: Any) -> Any:
            out = super().set_inputs_first_pass(**kwargs)
            texts, self.verified = self.verified, None
            cad, anchors = kwargs["cad"], kwargs["next_token_ids"]
            batch = cad.batch_size()
            if texts is None or len(texts) < batch:
                raise RuntimeError(
                    "blockdraft's lookup-aware DFlash: vLLM drafted without handing over the "
                    "requests' verified tokens (a vLLM other than 0.32 runs drafts otherwise)"
                )
            texts, ids = texts[:batch], self.request_ids[:batch]
            anchor_ids = anchors[:batch].tolist()
            for i, (text, anchor) in enumerate(zip(texts, anchor_ids, strict=True)):
                if not text or text[-1] != int(anchor):
                    raise RuntimeError(
                        f"blockdraft's lookup-aware DFlash: request {i}'s verified tokens end "
                        f"in {text[-1:]} but vLLM drafts from {int(anchor)}: its batch is "
                        "ordered otherwise than this plugin reads it"
                    )
            per_request = 1 + self.num_speculative_tokens
            if self.input_lookups is not None:
                for i, row in enumerate(self.input_lookups.propose(ids, texts)):
                    row = row[: self.num_speculative_tokens]
                    if row:
                        start = i * per_request + 1
                        self.input_ids[start : start + len(row)] = torch.tensor(
                            row, dtype=self.input_ids.dtype
                        )
            if self.hybrid_lookups is not None:
                self.hybrid_proposals = self.hybrid_lookups.propose(ids, texts)
            return out

        def _plain_greedy_draft(self, sampling_metadata: Any) -> bool:
            """Whether vLLM's own draft is the argmax of `compute_logits` (no sampled draft
            probabilities, no per-rank argmax, no heterogeneous vocabulary)."""
            sampled = getattr(self, "_enable_probabilistic_draft_probs", True)
            return (
                (not sampled or bool(sampling_metadata.all_greedy))
                and not getattr(self, "use_local_argmax_reduction", True)
                and not getattr(self, "use_heterogeneous_vocab", True)
            )

        def take_trimmed(self) -> list[int] | None:
            """Each request's block length this step (None: all K, no `trim` rule)."""
            lengths, self.trimmed = self.trimmed, None
            return lengths

        def _sample_draft_tokens(self, hidden_states: Any, sampling_metadata: Any) -> Any:
            looked_up, self.hybrid_proposals = self.hybrid_proposals, None
            hybrid = self.serving.hybrid_conf is not None and looked_up is not None
            trim = self.serving.trim_conf
            if not hybrid and trim is None:
                return super()._sample_draft_tokens(hidden_states, sampling_metadata)
            model = self.model
            # the drafter's own vocabulary, before vLLM spreads it over the target's
            draft_logits = model.logits_processor(model.lm_head, hidden_states)
            if self._plain_greedy_draft(sampling_metadata):
                # the argmax vLLM would take, from these logits: one LM-head pass, not two
                d2t = getattr(model, "draft_id_to_target_id", None)
                tokens, probs = draft_argmax_in_target_ids(draft_logits, d2t), None
            else:
                tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
            if trim is not None:
                requests = tokens.numel() // self.num_speculative_tokens
                self.trimmed = trimmed_lengths(draft_logits, requests, trim)
            if not hybrid:
                return tokens, probs
            return merge_hybrid(tokens, draft_logits, looked_up, self.serving.hybrid_conf, probs)

    LookupDFlashProposer.__qualname__ = "LookupDFlashProposer"
    LookupDFlashProposer.__module__ = __name__
    return LookupDFlashProposer


def install() -> None:
    """Make every DFlash proposer whose drafter carries `blockdraft.serving` lookup-aware
    (the plugin calls this once per vLLM process)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer  # lazy: vLLM is an optional extra

    original = DFlashProposer.__init__
    if getattr(original, "blockdraft_lookups", False):
        return

    def __init__(self: Any, vllm_config: Any, device: Any, runner: Any = None) -> None:
        original(self, vllm_config, device, runner)
        serving = serving_of(self.draft_model_config.hf_config)
        if serving is None:
            return
        if vllm_config.scheduler_config.async_scheduling:
            raise ValueError(
                "blockdraft's lookup-aware DFlash drafter reads each request's verified "
                "tokens, which asynchronous scheduling leaves unset: serve it with "
                "--no-async-scheduling"
            )
        if runner is None:
            raise ValueError("blockdraft's lookup-aware DFlash drafter needs vLLM's model runner")
        self.__class__ = _lookup_proposer_class()
        self.start_lookups(serving)
        _hand_over_verified(type(runner))

    __init__.blockdraft_lookups = True  # type: ignore[attr-defined]
    DFlashProposer.__init__ = __init__


def _hand_over_verified(runner_class: type) -> None:
    """Have the runner give a lookup-aware proposer the requests' verified tokens right
    before it drafts, and cut a trimmed proposer's drafts after (once per runner class)."""
    original = runner_class.propose_draft_token_ids
    if getattr(original, "blockdraft_lookups", False):
        return

    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "take_verified"):
            discard = getattr(getattr(self, "discard_request_mask", None), "np", None)
            texts = verified_texts(self.input_batch, sampled_token_ids, discard)
            drafter.take_verified(list(self.input_batch.req_ids), texts)
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        lengths = drafter.take_trimmed() if hasattr(drafter, "take_trimmed") else None
        if lengths is None or not isinstance(drafts, torch.Tensor):
            return drafts
        return trim_drafts(drafts, lengths)

    propose_draft_token_ids.blockdraft_lookups = True  # type: ignore[attr-defined]
    runner_class.propose_draft_token_ids = propose_draft_token_ids


__all__ = [
    "RequestLookups",
    "draft_argmax_in_target_ids",
    "install",
    "merge_hybrid",
    "trim_drafts",
    "trimmed_lengths",
    "verified_texts",
]
