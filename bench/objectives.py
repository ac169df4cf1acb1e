"""Cost of one forward+backward of each training objective relative to plain cross-entropy.

Synthetic drafter logits `[blocks, K, V]` (default 512 x 15 x 32k, fp32, CPU), the same
tensors for every contender. Contenders are run interleaved, round-robin with a rotating
start, so machine load affects all of them alike; the script prints the median time of
each and its ratio to the plain-CE median measured in the same run. Goals: D-PACE
<= 1.03x CE, EDR surrogate <= 2x CE.

Also measured side by side: the chunked `target_logprobs` path (final hidden states +
LM head, never more than one chunk of logits) against full logits + cross-entropy.

    python bench/objectives.py            # default sizes, ~2 minutes on 2 idle CPU cores
    python bench/objectives.py --quick    # 64 blocks, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from blockdraft.objectives import make_objective, target_logprobs, token_logprobs


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 blocks, 2 repeats")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--proposals", type=int, default=15, help="K (block_size - 1)")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=256, help="H for the hidden-state path")
    parser.add_argument(
        "--hidden-blocks",
        type=int,
        default=None,
        help="blocks for the hidden path (default blocks/4)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=4, help="EDR: rollouts the blocks form")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.repeats = 64, 2
    if args.hidden_blocks is None:
        args.hidden_blocks = max(1, args.blocks // 4)
    if args.blocks % args.rollouts:
        parser.error("--blocks must be a multiple of --rollouts")
    return args


def _time_interleaved(
    contenders: dict[str, Callable[[], None]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Round-robin timing with a rotating start; warm-up rounds are discarded."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_idx in range(warmup + repeats):
        shift = round_idx % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            contenders[name]()
            elapsed = time.perf_counter() - start
            if round_idx >= warmup:
                times[name].append(elapsed)
    return times


def _report(
    title: str, times: dict[str, list[float]], baseline: str, goals: dict[str, float]
) -> None:
    base = statistics.median(times[baseline])
    print(f"\n{title}")
    print(f"{'contender':<22}{'median s':>10}{'ratio':>8}  goal")
    for name, values in times.items():
        med = statistics.median(values)
        goal = goals.get(name)
        verdict = (
            "" if goal is None else f"<= {goal:.2f}x {'ok' if med / base <= goal else 'MISSED'}"
        )
        print(f"{name:<22}{med:>10.3f}{med / base:>7.3f}x  {verdict}")


def _block_contenders(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(args.seed)
    n, k, v = args.blocks, args.proposals, args.vocab
    logits = (torch.randn(n, k, v, generator=g) * 2).requires_grad_(True)
    targets = torch.randint(0, v, (n, k), generator=g)
    mask = torch.ones(n, k, dtype=torch.bool)
    mask[::7, k // 2 :] = False  # some blocks run past the end of their sequence
    ce_targets = torch.where(mask, targets, torch.full_like(targets, -100))
    target_probs = torch.softmax(torch.randn(n, k, v, generator=g) * 2, dim=-1)

    def step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            logits.grad = None
            loss_fn().backward()

        return run

    def plain_ce() -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, v), ce_targets.view(-1), ignore_index=-100)

    def block_objective(name: str, **params) -> Callable[[], torch.Tensor]:
        objective = make_objective(name, **params)
        needs_logits = objective.needs_target_distribution

        def loss() -> torch.Tensor:
            logq = token_logprobs(logits, ce_targets)
            extra = {"draft_logits": logits, "target_probs": target_probs} if needs_logits else {}
            return objective.loss(logq, mask, **extra).loss

        return loss

    contenders = {"plain CE": step(plain_ce)}
    for name in ("uniform", "decay", "dpace", "dpace-cumulative", "dpace-continuation", "e2e"):
        contenders[name] = step(block_objective(name))

    try:
        from blockdraft.objectives import edr  # noqa: F401  (presence check)
    except ImportError:
        print("edr: blockdraft.objectives.edr not importable, EDR contender skipped")
        return contenders

    objective = make_objective("edr", mode="greedy")
    rows = n // args.rollouts  # each rollout: `rows` round starts = L - 1 = rows

    def edr_loss() -> torch.Tensor:
        # Greedy relaxation A = q(x_t), c = 1 - A; round start n of a rollout uses block n.
        # The cost of padded proposals is irrelevant to the check, so the mask is not used.
        acceptance = token_logprobs(logits, targets).exp()
        per_rollout = list(acceptance.view(args.rollouts, rows, k).unbind(0))
        return objective.rounds_loss(per_rollout, [1 - a for a in per_rollout]).loss

    contenders["edr (greedy)"] = step(edr_loss)
    return contenders


def _hidden_contenders(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(args.seed + 1)
    rows, v, h = args.hidden_blocks * args.proposals, args.vocab, args.hidden
    hidden = (torch.randn(rows, h, generator=g)).requires_grad_(True)
    head = torch.randn(v, h, generator=g) / h**0.5  # frozen, as in training
    targets = torch.randint(0, v, (rows,), generator=g)

    def full() -> None:
        hidden.grad = None
        F.cross_entropy(hidden @ head.T, targets).backward()

    def chunked(chunk_rows: int | None) -> Callable[[], None]:
        def run() -> None:
            hidden.grad = None
            (-target_logprobs(hidden, head, targets, chunk_rows=chunk_rows).mean()).backward()

        return run

    return {
        "full logits + CE": full,
        "chunked (auto)": chunked(None),
        "chunked (64 rows)": chunked(64),
    }


def main() -> None:
    args = _parse()
    torch.manual_seed(args.seed)
    print(
        f"blocks={args.blocks} K={args.proposals} V={args.vocab} fp32 CPU "
        f"threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (+1 warm-up, interleaved)"
    )
    times = _time_interleaved(_block_contenders(args), args.repeats)
    goals = {
        "dpace": 1.03,
        "dpace-cumulative": 1.03,
        "dpace-continuation": 1.03,
        "edr (greedy)": 2.0,
    }
    _report("forward+backward to the logits, ratio to plain CE", times, "plain CE", goals)
    times = _time_interleaved(_hidden_contenders(args), args.repeats)
    _report(
        f"hidden path ({args.hidden_blocks} blocks, H={args.hidden}, frozen head): "
        "log q(target) + backward to hidden",
        times,
        "full logits + CE",
        {},
    )


if __name__ == "__main__":
    main()
