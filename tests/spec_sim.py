"""Reference simulator of real speculative decoding, for tests.

It is the independent check of the EDR/offline math, so it shares nothing with
`blockdraft.objectives.edr` or `blockdraft.evaluation`: it runs the actual algorithm
(draft K tokens, verify left to right, accept with prob min(1, p/q), on rejection
resample from norm([p - q]_+), bonus token after K acceptances, stop at a stop token or
at the maximum length) in plain Python on a toy problem.

Toy problem (small vocabulary, token 0 = EOS, index V = BOS padding):
- target `p_t(. | x_{<t}) = softmax(W_p[t, x_{t-1}, x_{t-2}])`;
- parallel drafter `q_{n,t} = softmax(W_q[t, t-n, x_n, x_{n-1}])` (a function of x_{<=n});
- semi-AR drafter adds a Markov bias `M[t-n, y_{t-1}]` from the previous token of the
  block (the anchor x_n for the first proposal, then the drafted tokens; teacher-forced
  `x_{t-1}` offline).

`block_inputs` lays out the same tables in the library's `[B, L-1, K, V]` per-block
layout for the offline side (pure indexing, no recursion).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


@dataclass
class ToyProblem:
    vocab: int
    max_len: int
    k: int
    target_logits: Tensor  # [max_len + 1, V + 1, V + 1, V]
    draft_logits: Tensor  # [max_len + 1, K + 1, V + 1, V + 1, V]
    markov: Tensor | None  # [K + 1, V + 1, V] or None (parallel drafter)
    eos: int = 0
    _p: list = field(default_factory=list, repr=False)
    _q: list = field(default_factory=list, repr=False)

    @property
    def bos(self) -> int:
        return self.vocab

    def __post_init__(self) -> None:
        self._p = torch.softmax(self.target_logits, -1).tolist()
        if self.markov is None:
            self._q = torch.softmax(self.draft_logits, -1).tolist()
        else:  # [t, h, a, b, prev, V]
            full = self.draft_logits.unsqueeze(-2) + self.markov[None, :, None, None, :, :]
            self._q = torch.softmax(full, -1).tolist()

    # --- distributions on a Python token list x (x[0] unused, x[t] = x_t) ---
    def p(self, t: int, x: list[int]) -> list[float]:
        prev1 = x[t - 1] if t - 1 >= 1 else self.bos
        prev2 = x[t - 2] if t - 2 >= 1 else self.bos
        return self._p[t][prev1][prev2]

    def q(self, n: int, t: int, x: list[int], prev_in_block: int) -> list[float]:
        a, b = x[n], (x[n - 1] if n - 1 >= 1 else self.bos)
        row = self._q[t][t - n][a][b]
        return row if self.markov is None else row[prev_in_block]


def make_problem(
    seed: int,
    vocab: int = 5,
    max_len: int = 10,
    k: int = 3,
    semi_ar: bool = False,
    eos_bias: float = -1.0,
    greedy_margin: float = 0.0,
) -> ToyProblem:
    """Random toy target/drafter. The drafter is a noisy copy of the target that sees the
    anchor context instead of the true previous tokens (so it is imperfect far from it).
    `greedy_margin` adds a random per-context favourite token to the target, so greedy
    rollouts are not all alike."""
    gen = torch.Generator().manual_seed(seed)
    v = vocab
    tl = torch.randn(max_len + 1, v + 1, v + 1, v, generator=gen, dtype=torch.float64) * 1.2
    tl[..., 0] += eos_bias
    if greedy_margin:
        fav = torch.randint(1, v, (max_len + 1, v + 1, v + 1, 1), generator=gen)
        tl.scatter_add_(-1, fav, torch.full(fav.shape, greedy_margin, dtype=torch.float64))
    # drafter for (t, h, x_n, x_{n-1}): target logits as if x_{t-1} = x_n, x_{t-2} = x_{n-1}
    dl = tl.unsqueeze(1).expand(max_len + 1, k + 1, v + 1, v + 1, v).clone()
    dl += torch.randn(dl.shape, generator=gen, dtype=torch.float64) * 0.6
    markov = (
        torch.randn(k + 1, v + 1, v, generator=gen, dtype=torch.float64) * 0.8 if semi_ar else None
    )
    return ToyProblem(
        vocab=v, max_len=max_len, k=k, target_logits=tl, draft_logits=dl, markov=markov
    )


def _draw(probs: list[float], rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    last = 0
    for i, p in enumerate(probs):
        if p > 0:
            last = i
            acc += p
            if u < acc:
                return i
    return last


def _argmax(probs: list[float]) -> int:
    return max(range(len(probs)), key=probs.__getitem__)


def simulate(
    prob: ToyProblem,
    rng: random.Random,
    verify: str = "sampling",
    drafter: str = "sample",
    first: int | None = None,
) -> tuple[int, list[int], list[int]]:
    """Run speculative decoding once; returns `(drafting rounds, x_1..x_L, accepted
    proposals per round)`.

    verify: "sampling" (lossless speculative sampling) or "greedy" (target argmax).
    drafter: "sample" (draw proposals from q) or "argmax". `first` fixes x_1 (a
    "prompt"); otherwise the prefill draws it from p_1 (argmax for greedy)."""
    x: list[int] = [-1]
    p1 = prob.p(1, x)
    x.append(
        first if first is not None else (_draw(p1, rng) if verify == "sampling" else _argmax(p1))
    )
    rounds, accepted = 0, []
    while x[-1] != prob.eos and len(x) - 1 < prob.max_len:
        rounds += 1
        n = len(x) - 1
        proposals: list[tuple[int, list[float]]] = []
        prev = x[n]
        for h in range(1, min(prob.k, prob.max_len - n) + 1):  # later proposals can never be used
            q = prob.q(n, n + h, x, prev)
            y = _argmax(q) if drafter == "argmax" else _draw(q, rng)
            proposals.append((y, q))
            prev = y
        finished = False
        accepted.append(0)
        for h, (y, q) in enumerate(proposals, start=1):
            p = prob.p(n + h, x)
            ok = y == _argmax(p) if verify == "greedy" else rng.random() < min(1.0, p[y] / q[y])
            if ok:
                accepted[-1] += 1
                x.append(y)
                if y == prob.eos or len(x) - 1 == prob.max_len:
                    finished = True
                    break
                continue
            if verify == "greedy":
                x.append(_argmax(p))
            else:
                resid = [max(0.0, pv - qv) for pv, qv in zip(p, q, strict=True)]
                total = sum(resid)
                x.append(_draw([r / total for r in resid], rng))
            finished = True  # the round ends after the correction token
            break
        if not finished:  # all K accepted: bonus token from the target
            p = prob.p(len(x), x)
            x.append(_draw(p, rng) if verify == "sampling" else _argmax(p))
    return rounds, x[1:], accepted


def greedy_rollout(prob: ToyProblem, first: int) -> list[int]:
    """The target's greedy continuation of x_1 = first."""
    x = [-1, first]
    while x[-1] != prob.eos and len(x) - 1 < prob.max_len:
        x.append(_argmax(prob.p(len(x), x)))
    return x[1:]


def sample_rollouts(
    prob: ToyProblem, num: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """`num` rollouts x ~ p (vectorised ancestral sampling): `(tokens [num, max_len],
    lengths [num])`, padded with token 1 after the end."""
    v, bos = prob.vocab, prob.bos
    cols = [torch.full((num,), bos), torch.full((num,), bos)]
    done = torch.zeros(num, dtype=torch.bool)
    lengths = torch.zeros(num, dtype=torch.long)
    for t in range(1, prob.max_len + 1):
        logits = prob.target_logits[t, cols[-1], cols[-2]]
        tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
        tok = torch.where(done, torch.ones_like(tok), tok)
        lengths += (~done).long()
        done |= tok == prob.eos
        cols.append(tok)
    assert v > 1
    return torch.stack(cols[2:], dim=1), lengths


def block_inputs(prob: ToyProblem, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-block offline inputs for rollouts `tokens [B, max_len]` (x_t at column t-1):
    `(draft_logits [B, M, K, V], target_logits [B, M, K, V], target_ids [B, M, K])`,
    M = max_len - 1, row n-1 / column h-1 for the proposal of x_{n+h}. Positions past
    max_len are clamped (they are ignored by the layout)."""
    b, big_l, k = tokens.shape[0], prob.max_len, prob.k
    padded = torch.cat([torch.full((b, 2), prob.bos), tokens], dim=1)  # x_t at column t + 1
    n = torch.arange(1, big_l).view(1, -1, 1)
    h = torch.arange(1, k + 1).view(1, 1, -1)
    t = (n + h).clamp(max=big_l).expand(b, -1, -1)
    rows = torch.arange(b).view(-1, 1, 1)
    prev1, prev2 = padded[rows, t], padded[rows, t - 1]
    ids = padded[rows, t + 1]
    target = prob.target_logits[t, prev1, prev2]
    hh = h.expand_as(t)
    anchor = padded[rows, (n + 1).expand_as(t)]
    before = padded[rows, n.expand_as(t)]
    draft = prob.draft_logits[t, hh, anchor, before]
    if prob.markov is not None:
        draft = draft + prob.markov[hh, prev1]
    return draft, target, ids


def enumerate_rollouts(prob: ToyProblem) -> tuple[Tensor, Tensor, Tensor]:
    """Every possible target rollout with its exact probability under p:
    `(tokens [R, max_len] padded with 1, lengths [R], probability [R])`. Tiny problems only."""
    out: list[tuple[list[int], float]] = []

    def grow(x: list[int], weight: float) -> None:
        if len(x) > 1 and (x[-1] == prob.eos or len(x) - 1 == prob.max_len):
            out.append((x[1:], weight))
            return
        for v, pv in enumerate(prob.p(len(x), x)):
            grow(x + [v], weight * pv)

    grow([-1], 1.0)
    tokens = torch.ones(len(out), prob.max_len, dtype=torch.long)
    for i, (seq, _) in enumerate(out):
        tokens[i, : len(seq)] = torch.tensor(seq)
    lengths = torch.tensor([len(seq) for seq, _ in out])
    weights = torch.tensor([w for _, w in out], dtype=torch.float64)
    return tokens, lengths, weights


def enumerate_paths(acc: list[list[float]], cost: list[list[float]], length: int, k: int) -> dict:
    """Walk every accept/reject path of speculative decoding on one rollout.

    Independent of the library: explicit branching over outcomes, accumulating path
    probabilities. Returns expected rounds, the cost objective, per-state visit
    probabilities, and per-proposal reach/accept expectations."""
    out = {
        "rounds": 0.0,
        "objective": 1.0 if length >= 2 else 0.0,
        "visit": {},
        "reach": [0.0] * k,
        "accept": [0.0] * k,
    }

    def round_from(n: int, prob: float) -> None:
        out["rounds"] += prob
        p = prob
        for h in range(1, k + 1):
            t = n + h
            out["visit"][(n, h)] = out["visit"].get((n, h), 0.0) + p
            out["reach"][h - 1] += p
            a = acc[n - 1][h - 1]
            out["accept"][h - 1] += p * a
            if t == length:  # x_L emitted whatever happens: generation over
                return
            out["objective"] += p * cost[n - 1][h - 1]
            if p * (1 - a) > 0:
                round_from(t, p * (1 - a))
            p = p * a
        out["visit"][(n, k + 1)] = out["visit"].get((n, k + 1), 0.0) + p
        if n + k + 1 < length:  # bonus token, a new round starts after it
            out["objective"] += p
            round_from(n + k + 1, p)

    if length >= 2:
        round_from(1, 1.0)
    return out
