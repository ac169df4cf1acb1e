"""Test doubles for the evaluation tests: a fake drafter, a pure-tensor fake target, stats.

`FakeDrafter` implements the drafter inference interface (`new_state`, `extend_context`,
`state.crop`, `draft_logits`, `sample_block`) *and* the training interface
(`forward_blocks`, `compute_logits`) from one set of tables, so online decoding and
offline scoring see the same q. It checks the context bookkeeping it is given (the
context must be exactly the positions < anchor), so a decoder that feeds the wrong
features fails loudly. Its q is `table[k, anchor] + ctx_proj(last context feature)
(+ markov[previous token] when sequential)`: it depends on the anchor, on the context
(through the features, like a real drafter) and optionally on the previous token in the
block (semi-AR style).

`FakeTarget` is a tiny-vocabulary second-order Markov "LM" with the `Target.forward`
signature and a croppable cache, so exact sequence distributions can be enumerated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from blockdraft.sampling import processed_probs, sample
from blockdraft.targets.target import TargetOutput


# --- statistics ------------------------------------------------------------------------
def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson chi-square goodness-of-fit p-value; cells with expected < 5 are pooled."""
    observed = observed.double()
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    # Any observation in a zero-probability cell is an outright failure.
    if observed[expected_probs <= 0].sum() > 0:
        return 0.0, float("inf"), 0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    pval = float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64),
            torch.tensor(stat / 2.0, dtype=torch.float64),
        )
    )
    return pval, stat, df


# --- fake target ----------------------------------------------------------------------
class FakeCache:
    """Token-list cache with the HF cache methods `crop_cache` uses (4.x `crop(max_length)`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def crop(self, max_length: int) -> None:
        self.tokens = self.tokens[:max_length]


class FakeTarget:
    """Second-order Markov model: logits at position i = table[x_{i-1}, x_i] (x_{-1} = V)."""

    def __init__(self, vocab: int = 4, seed: int = 0, scale: float = 1.5, stop_token_ids=()):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab
        self.table = torch.randn(vocab + 1, vocab, vocab, generator=g, dtype=torch.float64) * scale
        self.stop_token_ids = sorted(stop_token_ids)
        self.feature_size = 2 * vocab + 1
        self.device = torch.device("cpu")
        self.dtype = torch.float64
        self.name = "fake-markov"
        self.mask_token_id = vocab - 1
        self.layer_ids = [0]

    def _features(self, seq: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.full_like(seq[:, :1], self.vocab_size), seq[:, :-1]], dim=1)
        f = torch.zeros(*seq.shape, self.feature_size, dtype=torch.float64)
        f.scatter_(-1, seq.unsqueeze(-1), 1.0)
        f.scatter_(-1, (prev + self.vocab_size).unsqueeze(-1), 1.0)
        return f

    def forward(
        self,
        input_ids,
        *,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        logits_to_keep=0,
    ) -> TargetOutput:
        if use_cache and cache is None:
            cache = FakeCache()
        past = cache.tokens if cache is not None else []
        if past and input_ids.shape[0] != 1:
            raise ValueError("FakeTarget caches batch 1 only")
        seq = torch.cat(
            [
                torch.tensor([past] * input_ids.shape[0], dtype=torch.long).reshape(
                    input_ids.shape[0], len(past)
                ),
                input_ids.long(),
            ],
            dim=1,
        )
        prev = torch.cat([torch.full_like(seq[:, :1], self.vocab_size), seq[:, :-1]], dim=1)
        logits = self.table[prev, seq][:, len(past) :]
        feats = self._features(seq)[:, len(past) :]
        if use_cache:
            cache.tokens = seq[0].tolist()
        return TargetOutput(logits=logits, features=feats, cache=cache if use_cache else None)

    def sequence_probs(
        self, prompt: list[int], length: int, temperature: float, top_p=1.0, top_k=0
    ):
        """Exact distribution over responses (stop tokens end a response early).

        Returns {tuple(response): probability}; responses shorter than `length` end in a
        stop token.
        """
        out: dict[tuple[int, ...], float] = {}

        def rec(resp: tuple[int, ...], prob: float) -> None:
            if len(resp) == length or (resp and resp[-1] in self.stop_token_ids):
                out[resp] = out.get(resp, 0.0) + prob
                return
            seq = torch.tensor([list(prompt) + list(resp)])
            logits = self.forward(seq).logits[0, -1]
            p = processed_probs(logits, temperature, top_p, top_k)
            for v in range(self.vocab_size):
                if p[v] > 0:
                    rec(resp + (v,), prob * float(p[v]))

        rec((), 1.0)
        return out


# --- fake drafter ---------------------------------------------------------------------
@dataclass
class FakeState:
    features: list[torch.Tensor] = field(default_factory=list)  # one [F] per context position

    @property
    def length(self) -> int:
        return len(self.features)

    def crop(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot crop a context of {self.length} to {length}")
        del self.features[length:]


class FakeDrafter:
    """Table drafter with the real drafter's inference and training interfaces."""

    def __init__(
        self,
        table: torch.Tensor,
        ctx_proj: torch.Tensor | None = None,
        markov: torch.Tensor | None = None,
    ) -> None:
        self.table = table  # [K, V, V]: slot k, anchor -> logits
        self.ctx_proj = ctx_proj  # [F, V] or None
        self.markov = markov  # [V, V] or None: bias from the previous token in the block
        self.block_size = table.shape[0] + 1
        self.num_proposals = table.shape[0]
        self.sequential = markov is not None
        self.calls = 0

    # inference
    def new_state(self) -> FakeState:
        return FakeState()

    def extend_context(
        self, state: FakeState, features_new: torch.Tensor, start_position: int
    ) -> None:
        if start_position != state.length:
            raise AssertionError(f"context at {start_position} but state holds {state.length}")
        state.features.extend(features_new[0].to(self.table.dtype).unbind(0))

    def _parallel(self, anchor_id: int, last_feature: torch.Tensor | None) -> torch.Tensor:
        logits = self.table[:, anchor_id].clone()
        if self.ctx_proj is not None and last_feature is not None:
            logits = logits + last_feature.to(self.ctx_proj.dtype) @ self.ctx_proj
        return logits

    def draft_hidden(self, state: FakeState, anchor_id: int, anchor_position: int) -> torch.Tensor:
        """[K, H] with H = V: the fake's "hidden state" is its parallel logits."""
        if state.length != anchor_position:
            raise AssertionError(
                f"anchor at {anchor_position} but context has {state.length} positions"
            )
        self.calls += 1
        return self._parallel(int(anchor_id), state.features[-1] if state.features else None)

    def draft_logits(self, state: FakeState, anchor_id: int, anchor_position: int) -> torch.Tensor:
        return self.compute_logits(self.draft_hidden(state, anchor_id, anchor_position), None)

    def sample_block(
        self,
        state,
        anchor_id,
        anchor_position,
        temperature,
        generator=None,
        top_p: float = 1.0,
        top_k: int = 0,
    ):
        base = self.draft_logits(state, anchor_id, anchor_position)
        tokens, qs, prev = [], [], int(anchor_id)
        for k in range(self.num_proposals):
            logits = base[k] + (self.markov[prev] if self.markov is not None else 0.0)
            q = processed_probs(logits, temperature, top_p, top_k)
            tok = int(q.argmax()) if temperature == 0 else int(sample(q, generator))
            tokens.append(tok)
            qs.append(q)
            prev = tok
        return torch.tensor(tokens), torch.stack(qs)

    # training / scoring
    def forward_blocks(
        self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor
    ):
        b, a = anchors.shape
        out = torch.zeros(b, a, self.num_proposals, self.table.shape[-1], dtype=self.table.dtype)
        for i in range(b):
            for j in range(a):
                pos = int(anchors[i, j])
                if pos < 0:
                    continue
                last = features[i, pos - 1] if pos > 0 else None
                out[i, j] = self._parallel(int(input_ids[i, pos]), last)
        return out

    def compute_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.markov is None or prev_tokens is None:
            return hidden
        return hidden + self.markov[prev_tokens]

    draft_ids = None  # the full vocabulary: its own logits are the target-space ones

    def compute_draft_logits(self, hidden, prev_tokens=None) -> torch.Tensor:
        return self.compute_logits(hidden, prev_tokens)

    # slot-by-slot drafting (decoding/proposers.draft_block), as a sequential drafter has it
    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def slot_logits(self, hidden, prev_tokens, base: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(base, prev_tokens)


def oracle_drafter(
    target,
    num_proposals: int,
    *,
    strength: float = 4.0,
    noise: float = 1.0,
    ctx_scale: float = 0.0,
    markov_scale: float = 0.0,
    seed: int = 0,
) -> FakeDrafter:
    """A fake drafter that is often right: it proposes the target's greedy continuation
    from the anchor alone (ignoring earlier context), blurred by noise."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    seqs = torch.arange(vocab).unsqueeze(1)
    for _ in range(num_proposals):
        nxt = target.forward(seqs).logits[:, -1].argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, nxt], dim=1)
    cont = seqs[:, 1:]  # [V, K]
    table = torch.randn(num_proposals, vocab, vocab, generator=g, dtype=torch.float64) * noise
    table.scatter_add_(
        -1,
        cont.T.unsqueeze(-1),
        torch.full((num_proposals, vocab, 1), strength, dtype=torch.float64),
    )
    ctx = None
    if ctx_scale:
        ctx = torch.randn(target.feature_size, vocab, generator=g, dtype=torch.float64) * ctx_scale
    markov = None
    if markov_scale:
        markov = torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * markov_scale
    return FakeDrafter(table, ctx, markov)


def all_sequences(vocab: int, length: int):
    return list(itertools.product(range(vocab), repeat=length))


def wilson_halfwidth(k: int, n: int, z: float = 3.29) -> float:
    return z * math.sqrt(max(k * (n - k), 1) / n) / n


class MemoDrafter(FakeDrafter):
    """A fake drafter that has memorised the target's continuations of given sequences.

    It recognises a context by the target feature of the position just before the anchor
    (nearest stored feature with the same anchor token) and proposes the memorised next K
    tokens, each replaced by a random token with probability `error_rate`. Unknown contexts
    get fixed random logits. On the memorised greedy outputs it is right most of the time,
    so greedy tests see long accepted runs *and* rejections.
    """

    def __init__(
        self,
        target,
        sequences,
        prompt_lens,
        num_proposals: int,
        error_rate: float = 0.3,
        strength: float = 8.0,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        vocab = target.vocab_size
        keys, anchor_ids, tables = [], [], []
        for seq, plen in zip(sequences, prompt_lens, strict=True):
            feats = target.forward(torch.tensor([seq])).features[0].double()
            for a in range(plen, len(seq)):
                cont = torch.tensor(list(seq[a + 1 : a + 1 + num_proposals]), dtype=torch.long)
                cont = torch.cat(
                    [cont, torch.randint(vocab, (num_proposals - cont.numel(),), generator=g)]
                )
                wrong = torch.rand(num_proposals, generator=g) < error_rate
                cont = torch.where(wrong, torch.randint(vocab, (num_proposals,), generator=g), cont)
                logits = torch.randn(num_proposals, vocab, generator=g, dtype=torch.float64)
                logits[torch.arange(num_proposals), cont] += strength
                keys.append(feats[a - 1])
                anchor_ids.append(seq[a])
                tables.append(logits)
        super().__init__(torch.randn(num_proposals, vocab, vocab, generator=g, dtype=torch.float64))
        self.keys = torch.stack(keys)
        self.anchor_ids = torch.tensor(anchor_ids)
        self.memo = torch.stack(tables)
        self.hits = 0

    @classmethod
    def of_outputs(cls, target, prompts, outputs, num_proposals: int = 4) -> MemoDrafter:
        """The tests' usual memo drafter: memorised `prompt + output`, wrong 30% per slot."""
        return cls(
            target,
            [p + o for p, o in zip(prompts, outputs, strict=True)],
            [len(p) for p in prompts],
            num_proposals=num_proposals,
            error_rate=0.3,
            seed=3,
        )

    def _parallel(self, anchor_id: int, last_feature: torch.Tensor | None) -> torch.Tensor:
        if last_feature is not None:
            cand = (self.anchor_ids == anchor_id).nonzero().flatten()
            if cand.numel():
                dist = (self.keys[cand] - last_feature.double()).norm(dim=-1)
                best = int(dist.argmin())
                if float(dist[best]) < 1e-3 * (1 + float(last_feature.norm())):
                    self.hits += 1
                    return self.memo[cand[best]].clone()
        return self.table[:, anchor_id].clone()


def greedy_decode_case(drafter_kind: str):
    """(target, prompts, greedy AR outputs, drafter) for loop-vs-AR tests: 4 random prompts
    on a random llama target; `memo` proposes the AR outputs, `ngram` is prompt lookup."""
    from blockdraft.decoding.loop import ar_generate
    from blockdraft.drafters.ngram import NgramDrafter
    from random_targets import make_random_target

    target = make_random_target("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (6,), generator=g).tolist() for _ in range(4)]
    ar = [ar_generate(target, p, max_new_tokens=30) for p in prompts]
    if drafter_kind == "memo":
        drafter = MemoDrafter.of_outputs(target, prompts, ar)
    else:
        drafter = NgramDrafter(num_proposals=4, match="first")
    return target, prompts, ar, drafter
