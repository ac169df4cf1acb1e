"""`blockdraft demo [--target tiny|gemma-3-270m|<hf id or path>] [--out DIR]`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from blockdraft.cli.arguments import (
    int_at_least_2,
    nonnegative_float,
    positive_float,
    positive_int,
    seed_int,
)
from blockdraft.cli.target_options import MASK_TOKEN_HELP
from blockdraft.devices import DTYPES
from blockdraft.heap import retain_freed_memory
from blockdraft.pipeline.demo import DemoSettings, run_demo
from blockdraft.threads import add_threads_arg, configure_cpu

_HELP = {
    "target": "target model: tiny (embedded, default), gemma-3-270m, or an HF id/local path",
    "out": "output directory (stages are cached here and reused on the next run)",
    "temperature": "sampling temperature of rollouts and decoding (0 = greedy)",
    "block_size": "drafter block size (anchor + K proposals)",
    "draft_vocab_size": "tokens the drafters score (a reduced draft vocabulary; default: the "
    "training responses' distinct tokens rounded up to a power of two, or the whole "
    "vocabulary when that reaches it)",
    "device": "device of every model: auto (the GPU if there is one, else cpu), cpu, cuda, cuda:N",
    "dtype": "dtype of the target and the drafters: auto (bfloat16 on GPU, float32 on CPU), "
    "float32, bfloat16, float16",
    "mask_token": MASK_TOKEN_HELP,
}

EXAMPLE = """examples:
  blockdraft demo                          # the embedded tiny target on the CPU (cached stages)
  blockdraft demo --target gemma-3-270m --out demo-gemma --temperature 1
"""
# the allowed values of a setting that has a fixed set
_CHOICES = {"dtype": list(DTYPES)}

# the checked flag type of each numeric setting (the others are checked by name below)
_TYPES = {
    "temperature": nonnegative_float,
    "block_size": int_at_least_2,
    "seed": seed_int,
    "draft_vocab_size": positive_int,
    "mask_token": str,
}


def _flag_type(name: str, value: object):
    if name in _TYPES:
        return _TYPES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return type(value)
    return positive_int if isinstance(value, int) else positive_float


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the whole pipeline and compare objectives",
        description="Rollouts, five drafters (decay and D-PACE from scratch, then E2E, EDR and "
        "a D-PACE control fine-tuned from the D-PACE one), exact offline MAL with paired "
        "comparisons, real decoding and a report, each stage cached in --out.",
        epilog=EXAMPLE,
    )
    defaults = DemoSettings()
    for f in fields(DemoSettings):
        if f.name == "extra_overrides":
            continue
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        p.add_argument(
            flag,
            type=_flag_type(f.name, value),
            default=value,
            choices=_CHOICES.get(f.name),
            help=_HELP.get(f.name, f"(default: {value})"),
        )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="extra dotted training-config overrides for every drafter",
    )
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_cpu(args.threads)
    retain_freed_memory()  # training steps reuse their big buffers (heap.py)
    values = {
        f.name: getattr(args, f.name) for f in fields(DemoSettings) if f.name != "extra_overrides"
    }
    run_demo(DemoSettings(**values, extra_overrides=list(args.overrides)))
    return 0
