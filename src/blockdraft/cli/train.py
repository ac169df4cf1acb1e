"""`blockdraft train --config FILE|NAME [key.sub=value ...] [--resume]`.

`--config` takes a YAML file or the name of a shipped recipe (`--list-configs`;
`blockdraft.recipes`); dotted overrides may stand anywhere on the line. Runs the same
under `torchrun --nproc_per_node N -m blockdraft train ...` (data parallel); see
docs/training.md. Config and setup problems print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from blockdraft.cli.arguments import PrintAndExit, positive_float, positive_int, user_error
from blockdraft.data.rollouts.store import RolloutError
from blockdraft.heap import retain_freed_memory
from blockdraft.pipeline.report import read_metrics
from blockdraft.recipes import TRAIN, recipe_listing, resolve_recipe
from blockdraft.threads import add_threads_arg, configure_cpu, runs_on_cpu
from blockdraft.training.builders import TrainSetupError
from blockdraft.training.config import ConfigError, dump_yaml, load_config
from blockdraft.training.loop import NonFiniteLossError
from blockdraft.training.memory_plan import plan_memory
from blockdraft.training.trainer import train

EXAMPLE = """examples:
  blockdraft train --config tiny data.train_rollouts=rollouts/tiny-greedy run_dir=runs/tiny
  blockdraft train --config configs/tiny.yaml run_dir=runs/tiny --resume  # after Ctrl-C
  blockdraft train --config dflash-qwen3-8b target.name=Qwen/Qwen3-8B --plan --nproc 8
  blockdraft train --list-configs     # the shipped recipes (a path to any YAML works too)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a drafter (any objective; resumable; torchrun for multi-process)",
        description="Train a parallel block drafter on target rollouts. Settings come from a YAML "
        "config (a file, or a shipped recipe by name) and dotted overrides such as "
        "optim.lr=3e-4 objective.name=dpace, anywhere on the command line.",
        epilog=EXAMPLE,
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML config file, or the name of a shipped recipe (`--list-configs`); default: "
        "the built-in defaults",
    )
    p.add_argument(
        "--list-configs",
        action=PrintAndExit,
        text=lambda: recipe_listing(TRAIN),
        help="list the shipped config recipes and exit",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="override config keys, e.g. optim.max_steps=100 objective.alpha=0.3",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in run_dir (exactly where it stopped; a "
        "run_dir without a checkpoint yet starts from the beginning; a missing one is refused)",
    )
    p.add_argument(
        "--allow-changed",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: let this objective/target key differ from the checkpoint's "
        "(refused otherwise; repeat or comma-separate for several, e.g. objective.name)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in run_dir (deletes its final/, best/, checkpoints/, "
        "metrics); without it such a run_dir is refused",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the estimated per-GPU memory of this config and exit (reads only the "
        "target's HF config, no weights)",
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="--plan: world size (default: $WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--device-gb",
        type=positive_float,
        default=80.0,
        help="--plan: device memory to fit in (GB)",
    )
    p.add_argument(
        "--plan-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="--plan: device type whose attention path and dtypes are planned",
    )
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    allow_changed = [k.strip() for v in args.allow_changed for k in v.split(",") if k.strip()]
    try:
        path = resolve_recipe(args.config, TRAIN) if args.config is not None else None
        cfg = load_config(path, args.overrides)
        if allow_changed and not args.resume:
            raise ConfigError("--allow-changed: only means something with --resume")
    except ConfigError as exc:
        return user_error(exc)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if args.plan:
        world = args.nproc if args.nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
        try:
            plan = plan_memory(cfg, world, args.plan_device)
        except ValueError as exc:
            return user_error(exc)
        print(plan.render(args.device_gb))
        return 0 if plan.fits(args.device_gb * 1e9) else 1
    # process-wide CPU settings only for work on a CPU (a GPU run keeps the defaults)
    configure_cpu(args.threads, cfg.device)
    if runs_on_cpu(cfg.device):
        retain_freed_memory()  # training steps reuse their big buffers (heap.py)

    if args.resume and not Path(cfg.run_dir).exists():
        return user_error(
            f"--resume: no run directory {cfg.run_dir}: drop --resume to start a new run "
            "(or set run_dir=... to the run to continue)"
        )
    try:
        final = train(
            cfg, resume=args.resume, overwrite=args.overwrite, allow_changed=allow_changed
        )
    except (ConfigError, TrainSetupError, RolloutError) as exc:
        return user_error(exc)
    except NonFiniteLossError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports
        mal = _final_eval_mal(Path(cfg.run_dir) / "metrics.jsonl")
        held_out = f"; final held-out MAL {mal[1]:.4f} (step {mal[0]})" if mal else ""
        print(f"final drafter: {final}{held_out}")
    return 0


def _final_eval_mal(metrics: Path) -> tuple[int, float] | None:
    """(step, MAL) of the last held-out evaluation in a run's metrics.jsonl, if any."""
    try:
        events, _ = read_metrics(metrics)
    except OSError:
        return None
    evals = [e for e in events if e.get("event") == "eval" and e.get("eval_mal") is not None]
    return (int(evals[-1]["step"]), float(evals[-1]["eval_mal"])) if evals else None
