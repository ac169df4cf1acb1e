"""`blockdraft rollout` with its own loop vs `--engine vllm`: tokens/s side by side.

Why: on GPUs the engine is how users make the 100k+ rollouts DFlash's recipe needs, and
the claim that it is faster has to be measured on the same prompts, batch and settings in
one run (this machine moves identical work by 10-15% between runs). Each round writes a
fresh set with each generator, alternating which goes first; the line reports wall-clock
tokens/s (vLLM runs in a child process, so this process's CPU time would miss it),
the median ratio engine / built-in over rounds, and at T = 0 how many rows are identical.
The engine's start-up (model load, warm-up) is timed apart and not in its tokens/s.

    python bench/engine_rollout.py --target tiny --prompts stdlib:eval --limit 32 \
        --batch 32 --max-new-tokens 128 --rounds 3
    python bench/engine_rollout.py --target PATH_TO_SMOLLM2 --prompts \
        ../shared/data/gsm8k/test.jsonl:question --limit 64 --batch 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.data.rollouts.engine import engine_rows
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.sampling import SamplingSettings
from blockdraft.targets.registry import load_target, model_directory
from blockdraft.threads import configure_cpu


def _timed(target, prompts, out, settings, batch, rows=None) -> tuple[float, int]:
    start = time.perf_counter()
    made = generate_rollouts(
        target,
        prompts,
        out,
        settings,
        batch_size=batch,
        progress=False,
        row_generator=rows,
        engine_name=rows.name if rows is not None else None,
    )
    return time.perf_counter() - start, int(made.manifest["num_response_tokens"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny", help="named target or local model folder")
    p.add_argument("--prompts", default="stdlib:eval", help="prompt spec")
    p.add_argument("--limit", type=int, default=32, help="prompts per set")
    p.add_argument("--batch", type=int, default=32, help="rows per generation call")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the built-in loop")
    args = p.parse_args()
    configure_cpu(args.threads, "cpu")
    target = load_target(args.target, progress=False)
    prompts = load_prompts(args.prompts, limit=args.limit)
    settings = SamplingSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    started = time.perf_counter()
    rows = engine_rows(
        "vllm",
        model_directory(target),
        settings,
        target.stop_token_ids,
        dtype=str(target.dtype).removeprefix("torch."),
        max_model_len=target.context_length or args.max_new_tokens + 4096,
    )
    assert rows is not None
    print(f"vLLM start-up (load, warm-up): {time.perf_counter() - started:.1f} s")
    ratios = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                sides = [("built-in", None), ("vllm", rows)]
                if r % 2:
                    sides.reverse()
                rates, dirs = {}, {}
                for name, gen in sides:
                    out = Path(tmp) / f"{name}-{r}"
                    seconds, tokens = _timed(target, prompts, out, settings, args.batch, gen)
                    rates[name], dirs[name] = tokens / seconds, out
                same = sum(
                    a.response_ids.tolist() == b.response_ids.tolist()
                    for a, b in zip(
                        RolloutSet.open(dirs["built-in"]),
                        RolloutSet.open(dirs["vllm"]),
                        strict=True,
                    )
                )
                ratios.append(rates["vllm"] / rates["built-in"])
                print(
                    f"round {r}: built-in {rates['built-in']:.1f} tok/s, vLLM {rates['vllm']:.1f} "
                    f"tok/s, ratio {ratios[-1]:.2f}x, identical rows {same}/{len(prompts)}"
                )
    finally:
        rows.close()
    print(
        f"vLLM / built-in tokens/s, median over {args.rounds} rounds: "
        f"{statistics.median(ratios):.2f}x (batch {args.batch}, T = {args.temperature:g})"
    )


if __name__ == "__main__":
    main()
