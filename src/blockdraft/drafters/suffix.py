"""The suffix-decoding drafter: vLLM's `method: suffix` (Arctic Inference's suffix trees).

A second free baseline beside prompt lookup. Where `ngram` takes the first earlier
occurrence of the last few tokens, suffix decoding keeps a suffix tree (every substring
up to `depth` tokens, with counts) and, for every suffix of the text that occurs, follows
the most frequent continuation while its estimated probability (the product of
child/parent counts) stays >= `prob`, proposing at most `factor * match length` tokens;
the draft with the highest summed probability wins (ties: the longer match). Two trees
are searched: one over this request's prompt and response so far, and, in vLLM by
default, a global one over earlier responses (`global=1`).

This module re-implements the rule, not the library, so the offline evaluator scores what
vLLM serves without compiling `arctic-inference` (a C++ extension): an uncompressed trie
whose children keep Arctic's order (count descending; among equal counts, the order its
sibling list reaches by the same moves), with its float32 arithmetic.
tests/engines/test_suffix_rule.py checks it proposal for proposal against Arctic's own
tree where that is installed (`make engine`).

What the offline state is, round by round (round n anchors x_n): the request's tree holds
prompt + x_1..x_n, as vLLM's tree after the step that sampled x_n; with `global=1` the
global tree holds the earlier rollouts' responses of the set, in set order (vLLM at
batch 1 taking the prompts in order), and x_1..x_n of this one. Not modelled: tokens vLLM
accepted past the end of an earlier response (its last round's draft past a stop token or
max_tokens, unknown offline), and the cap of proposals at the model's context length.
With `global=0` (the default, vLLM's `suffix_decoding_max_cached_requests: 0`) every
rollout is scored on its own and the rounds equal vLLM's exactly.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockdraft.drafters.ngram import future_tokens

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """`x` rounded to float32: Arctic's arithmetic is float32 (a float32 product, quotient
    or sum of float32 values is the double result rounded once)."""
    return _F32.unpack(_F32.pack(x))[0]


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's suffix settings: K (`num_speculative_tokens`), tree depth, spec factor,
    min token probability, and whether the global tree over earlier responses is on."""

    num_proposals: int = 7
    max_depth: int = 24  # suffix_decoding_max_tree_depth
    max_spec_factor: float = 1.0  # suffix_decoding_max_spec_factor
    min_token_prob: float = 0.1  # suffix_decoding_min_token_prob
    global_tree: bool = False  # suffix_decoding_max_cached_requests > 0

    @property
    def block_size(self) -> int:
        return self.num_proposals + 1


class _Node:
    """A trie node: how many stored suffixes pass through (or end at) it, and its children
    by token and in Arctic's sibling order (`order[0]` is the continuation followed)."""

    __slots__ = ("children", "count", "order", "token")

    def __init__(self, token: int, count: int = 0) -> None:
        self.token, self.count = token, count
        # most nodes stay leaves: they share one empty map until their first child
        self.children: dict[int, _Node] = _LEAF
        self.order: list[_Node] = _LEAF_ORDER


_LEAF: dict[int, _Node] = {}  # never written to: `append` gives a node its own on first use
_LEAF_ORDER: list[_Node] = []


def _increment(order: list[_Node], node: _Node) -> None:
    """Add 1 to `node`'s count and move it where Arctic's sibling list puts it: a node
    whose left neighbour then has a count at most its own moves in front of the first
    sibling holding that neighbour's count (so it heads the group of its new count when
    it headed its old one, and joins that group's end otherwise)."""
    i = order.index(node)
    c = node.count
    if i and order[i - 1].count <= c + 1:
        group = order[i - 1].count
        j = i - 1
        while j and order[j - 1].count == group:
            j -= 1
        del order[i]
        order.insert(j, node)
    node.count = c + 1


class SuffixTree:
    """Every substring of up to `max_depth` tokens of the sequences added so far, grown
    one token at a time (Arctic's `SuffixTree.append` / `speculate`, path drafts only)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1)
        self.active: dict[int, deque[_Node]] = {}  # per sequence: where its suffixes end

    def append(self, seq_id: int, token: int) -> None:
        active = self.active.setdefault(seq_id, deque())
        active.append(self.root)
        self.root.count += 1
        if len(active) > self.max_depth:
            active.popleft()
        for i, node in enumerate(active):
            child = node.children.get(token)
            if child is None:
                child = _Node(token, 1)
                if node.order is _LEAF_ORDER:
                    node.children, node.order = {}, []
                node.children[token] = child
                node.order.append(child)  # count 1: the end of the sibling list
            else:
                _increment(node.order, child)
            active[i] = child

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(seq_id, int(t))

    def _match(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def speculate(
        self, context: Sequence[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """(proposal, score) for `context`: every match length 1..len-1 (a longer one
        only if the shorter occurs), the best summed probability, the longer on ties."""
        best: tuple[list[int], float] = ([], 0.0)
        factor, min_prob = f32(factor), f32(min_prob)
        for m in range(1, len(context)):
            node = self._match(context[len(context) - m :])
            if node is None:
                break
            limit = max(min(max_tokens, int(f32(m * factor) + 1e-6)), 0)
            draft = _follow(node, limit, min_prob)
            if draft[1] >= best[1]:
                best = draft
        return best


def _follow(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation from `node` while its probability >= `min_prob`."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < limit and node.order:
        child = node.order[0]
        prob = f32(prob * f32(child.count / node.count))
        if prob < min_prob:
            break
        tokens.append(child.token)
        score = f32(score + prob)
        node = child
    return tokens, score


class SuffixDrafter:
    """Suffix decoding, usable wherever prompt lookup is (eval, compare, suite, decode)."""

    objective = "none"

    def __init__(
        self,
        num_proposals: int = 7,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        global_tree: bool = False,
    ) -> None:
        if num_proposals < 1:
            raise ValueError(f"suffix drafter: k must be >= 1, got {num_proposals}")
        if max_depth < 1:
            raise ValueError(f"suffix drafter: depth must be >= 1, got {max_depth}")
        if not max_spec_factor >= 0:
            raise ValueError(f"suffix drafter: factor must be >= 0, got {max_spec_factor}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"suffix drafter: prob must be in [0, 1], got {min_token_prob}")
        self.config = SuffixConfig(
            num_proposals, max_depth, float(max_spec_factor), float(min_token_prob),
            bool(global_tree),
        )  # fmt: skip

    @property
    def num_proposals(self) -> int:
        return self.config.num_proposals

    @property
    def name(self) -> str:
        c, d = self.config, SuffixConfig()
        opts = [f"k={c.num_proposals}"] if c.num_proposals != d.num_proposals else []
        if c.max_depth != d.max_depth:
            opts.append(f"depth={c.max_depth}")
        if c.max_spec_factor != d.max_spec_factor:
            opts.append(f"factor={c.max_spec_factor:g}")
        if c.min_token_prob != d.min_token_prob:
            opts.append(f"prob={c.min_token_prob:g}")
        if c.global_tree:
            opts.append("global=1")
        return "suffix" + (":" + ",".join(opts) if opts else "")

    def eval(self) -> SuffixDrafter:  # same call shape as a torch drafter
        return self

    def index(self) -> SuffixIndex:
        """A request's tree, grown with the verified text round by round (decoding)."""
        if self.config.global_tree:
            raise ValueError(
                "suffix:global=1 is scored offline only (eval, compare, suite): online "
                "decoding keeps no responses across prompts"
            )
        return SuffixIndex(self.config)

    def propose(self, tokens: Sequence[int] | torch.Tensor) -> list[int]:
        """Up to K tokens for the text `tokens` from its own tree (no global tree)."""
        seq = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return SuffixIndex(self.config).propose(seq)

    def proposals_of_rollouts(
        self, rollouts: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]]
    ) -> list[torch.Tensor]:
        """`[L_i-1, K]` long per (prompt, response), -1 past a proposal's length; with
        `global=1` each rollout also searches the earlier ones' responses, in order."""
        shared = SuffixTree(self.config.max_depth) if self.config.global_tree else None
        out = []
        for i, (prompt, response) in enumerate(rollouts):
            p = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            r = response.tolist() if isinstance(response, torch.Tensor) else list(response)
            out.append(self._proposals(p, r, shared, i))
        return out

    def _proposals(
        self, prompt: list[int], response: list[int], shared: SuffixTree | None, seq_id: int
    ) -> torch.Tensor:
        seq, P, L = prompt + response, len(prompt), len(response)
        out = torch.full((max(L - 1, 0), self.num_proposals), -1, dtype=torch.long)
        index = SuffixIndex(self.config, shared, seq_id)
        index.tree.extend(0, prompt)  # vLLM's `start_request`: the request's own tree
        index.done = P
        for n in range(1, L):  # the round anchored at x_n: prompt + x_1..x_n verified
            index.add(seq[P + n - 1])
            prop = index.speculate(seq, P + n)
            if prop:
                out[n - 1, : len(prop)] = torch.tensor(prop)
        if shared is not None and L:
            shared.append(seq_id, seq[-1])  # x_L: in the global tree for later rollouts
        return out

    def proposals_from_tokens(
        self, prompt_ids: Sequence[int] | torch.Tensor, response_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """`[L-1, K]` long: the proposal of every round start n of one rollout (no earlier
        responses), -1 past its length."""
        p = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        r = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        return self._proposals(p, r, None, 0)

    def acceptance_of_rollouts(
        self, rollouts: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]]
    ) -> list[torch.Tensor]:
        """`[L_i-1, K]` acceptances: 1 while the proposal matches the rollout (a
        deterministic proposal is accepted iff it is the token, at every temperature)."""
        props = self.proposals_of_rollouts(rollouts)
        return [
            (p == future_tokens(r, self.num_proposals)).float().cumprod(-1)
            for p, (_, r) in zip(props, rollouts, strict=True)
        ]

    def acceptance_from_tokens(
        self, prompt_ids: Sequence[int] | torch.Tensor, response_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """`[L-1, K]` acceptances of one rollout on its own tree."""
        props = self.proposals_from_tokens(prompt_ids, response_ids)
        return (props == future_tokens(response_ids, self.num_proposals)).float().cumprod(-1)


class SuffixIndex:
    """One request's state: its tree (prompt and verified response, sequence 0) and,
    with a global tree, this response added to it as sequence `seq_id`."""

    def __init__(
        self, cfg: SuffixConfig, shared: SuffixTree | None = None, seq_id: int = 0
    ) -> None:
        self.cfg, self.shared, self.seq_id = cfg, shared, seq_id
        self.tree = SuffixTree(cfg.max_depth)
        self.done = 0  # tokens of the text in `tree`

    def add(self, token: int) -> None:
        """A verified response token (vLLM's `add_active_response`)."""
        self.tree.append(0, token)
        self.done += 1
        if self.shared is not None:
            self.shared.append(self.seq_id, token)

    def speculate(self, seq: Sequence[int], end: int) -> list[int]:
        """The proposal after `seq[:end]`: the last `depth` tokens matched in the request's
        tree, then in the global one; the global draft only if it scores higher."""
        c = self.cfg
        context = seq[max(0, end - c.max_depth) : end]
        args = (context, c.num_proposals, c.max_spec_factor, c.min_token_prob)
        own = self.tree.speculate(*args)
        if self.shared is None:
            return own[0]
        other = self.shared.speculate(*args)
        return own[0] if own[1] >= other[1] else other[0]

    def propose(self, tokens: list[int]) -> list[int]:
        """Online decoding: the verified text so far (its start is the prompt)."""
        self.tree.extend(0, tokens[self.done :])
        self.done = len(tokens)
        return self.speculate(tokens, len(tokens))
