"""How much the `tiny` target's samples look like Python (research/results.md, "The tiny target").

For the first N held-out stdlib prompts (`stdlib:eval`: a function signature + docstring),
sample a continuation and measure the share of its complete lines that, appended to the
prompt, still parse as Python (non-blank lines; `ast.parse` on the longest parsable prefix, trailing
block openers closed with `pass`). `--reference` scores the functions' real bodies (cut
to the same token count) as the ceiling of the measure. Also prints a few samples. Usage:

    python research/scripts/tiny_quality.py [TARGET ...] [--n 32] [--tokens 96] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import ast
import textwrap

import torch

from blockdraft.data.stdlib_prompts import stdlib_prompts, stdlib_root
from blockdraft.targets.registry import load_target


def parsable_lines(prompt: str, continuation: str) -> tuple[int, int]:
    """(parsable, total) complete non-blank lines of `continuation` after `prompt`."""
    lines = continuation.split("\n")[:-1]  # the last line may be cut mid-way
    best = 0
    for n in range(1, len(lines) + 1):
        text = prompt + "\n".join(lines[:n]) + "\n"
        for candidate in (text, text + " " * 8 + "pass\n", text + " " * 4 + "pass\n"):
            try:
                ast.parse(candidate)
                best = n
                break
            except (SyntaxError, ValueError):
                continue
    nonblank = [bool(line.strip()) for line in lines]  # blank lines parse trivially
    return sum(nonblank[:best]), sum(nonblank)


def real_body(prompt_id: str, prompt: str) -> str:
    """The source that follows the prompt in its stdlib file (same dedent as the prompt)."""
    relpath, lineno, _ = prompt_id.removeprefix("stdlib/").rsplit(":", 2)
    source = (stdlib_root() / relpath).read_text(encoding="utf-8", errors="replace")
    node = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno == int(lineno)
    )
    lines = source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    return textwrap.dedent("".join(lines))[len(prompt) :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("targets", nargs="*", default=["tiny"])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--show", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="also score the real bodies")
    args = ap.parse_args()
    prompts = stdlib_prompts("eval", limit=args.n)
    if args.reference:
        tok = load_target(args.targets[0]).tokenizer
        ok = total = 0
        for p in prompts:
            ids = tok(real_body(p.id, p.text), add_special_tokens=False).input_ids
            a, b = parsable_lines(p.text, tok.decode(ids[: args.tokens]))
            ok, total = ok + a, total + b
        print(f"reference (real stdlib bodies): {ok}/{total} = {ok / max(1, total):.1%}")
    for name in args.targets:
        target = load_target(name)
        tok = target.tokenizer
        ok = total = 0
        for i, p in enumerate(prompts):
            ids = torch.tensor([tok(p.text, add_special_tokens=False).input_ids])
            torch.manual_seed(i)
            with torch.no_grad():
                out = target.model.generate(
                    ids,
                    max_new_tokens=args.tokens,
                    do_sample=args.temperature > 0,
                    temperature=args.temperature if args.temperature > 0 else None,
                    top_k=0,
                )
            cont = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            a, b = parsable_lines(p.text, cont)
            ok, total = ok + a, total + b
            if i < args.show:
                print(f"--- sample {i} ({a}/{b} lines parse)\n{p.text}{cont}\n")
        share = ok / max(1, total)
        print(
            f"{name}: {ok}/{total} = {share:.1%} of sampled non-blank lines parse as Python "
            f"({len(prompts)} stdlib:eval prompts, {args.tokens} tokens, T={args.temperature})"
        )


if __name__ == "__main__":
    main()
