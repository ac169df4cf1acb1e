"""The GPU check's measurements (issue 30), one part per process; `scripts/gpu_check.sh`
runs tests/gpu first, then every part under its own time limit, then `--part summary`.

Why one part per process: a part that compiles or runs slower than planned is killed at
its limit and the others still run; each part writes its JSON as it goes (status
"running" until it finishes), so a killed part still reports what it measured.

Parts (GPU shapes; `--cpu-smoke` runs the same code at tiny shapes on the CPU):

- `matmul`: the bf16 rate of a [8192]^3 product (median of 20, CUDA events, three input
  pairs in rotation): the denominator of every MFU here.
- `dpace`, `edr`, `e2e`: one `blockdraft train` step (`training/synthetic.py`: the
  trainer's builders and `loop.train_step`) of configs/dflash-qwen3-8b.yaml (D-PACE, and
  E2E on sampled rollouts) and configs/dflash-qwen3-8b-edr.yaml (sampling EDR, 512 round
  starts with gradient, a fresh drafter of the checkpoint's shape) on a random-weight
  Qwen3-8B-shaped target with `--target-layers` of its 36 decoder layers (bf16), one
  rollout of 512 + 2,560 tokens (T = 3,072): step time (median of the timed steps after
  the warm-up ones, which compile `flex`), drafter tokens/s, peak
  `torch.cuda.max_memory_allocated` next to `plan_memory` of the same config and target
  config, and the drafter step's MFU: its model FLOPs (counted below) over (step time -
  the target forward's time) over the `matmul` rate.
- `rollout`: `blockdraft rollout` (`generate_rollouts`) vs HF `generate` at batch 32,
  T = 1 with top-k 50 / top-p 0.95, same prompts (bench/rollout.py's runners), wall time.
- `decode`: batch 1, greedy: our AR loop vs HF `generate` (`decoding.hf_generate.
  ar_vs_hf`), and a drafter round (a random 5-layer drafter, block 16: acceptance means
  nothing, costs do) in AR steps (`decoding.loop.decode`'s per-phase round costs over
  its AR step time).
- `summary`: the table, `OUT/gpu_check.json`.

Random weights everywhere: the numbers are costs (time, memory, throughput), not quality.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/rollout.py's runners
PARTS = ("matmul", "dpace", "edr", "e2e", "rollout", "decode")
GiB = 1 << 30
FULL_TARGET_LAYERS = 36  # Qwen3-8B

# tiny stand-ins for --cpu-smoke (the same code paths, seconds on a CPU)
SMOKE_TARGET = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
)
SMOKE_TRAIN = {
    "data.max_seq_len": 128,
    "num_anchors": 16,
    "objective.max_anchors": 16,
    "drafter.num_layers": 2,
}


class Part:
    """One part's record, rewritten to `WORK/<name>.json` after every measurement."""

    def __init__(self, work: Path, name: str, smoke: bool) -> None:
        self.path = work / f"{name}.json"
        self.data = {"part": name, "status": "running", "smoke": smoke, "numbers": {}}
        self.t0 = time.perf_counter()
        self.save()

    def record(self, **numbers: object) -> None:
        self.data["numbers"].update(numbers)
        self.save()

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


# --- matmul ---------------------------------------------------------------------------------
def matmul_rate(device: torch.device, smoke: bool) -> dict[str, float]:
    """FLOP/s of a square product in the training dtype (bf16 on CUDA, fp32 on the CPU)."""
    n, reps = (512, 5) if smoke else (8192, 20)
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device).manual_seed(0)
    pairs = [
        (
            torch.randn(n, n, device=device, generator=g, dtype=dtype),
            torch.randn(n, n, device=device, generator=g, dtype=dtype),
        )
        for _ in range(3)
    ]
    for a, b in pairs:  # warm-up: handles, clocks
        a @ b
    times = []
    for i in range(reps):
        a, b = pairs[i % 3]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(timed(lambda a=a, b=b: a @ b, device))
    return {
        "matmul_n": n,
        "matmul_dtype": str(dtype),
        "matmul_flops": 2 * n**3 / statistics.median(times),
    }


def part_matmul(part: Part, device: torch.device, smoke: bool) -> None:
    part.record(**matmul_rate(device, smoke))


# --- training steps -------------------------------------------------------------------------
def shaped_target(device: torch.device, smoke: bool, layers: int):  # type: ignore[no-untyped-def]
    from fixture_targets import make_shaped_target

    if smoke:
        return make_shaped_target("qwen3-8b", device=device, **SMOKE_TARGET)
    return make_shaped_target(
        "qwen3-8b", device=device, dtype=torch.bfloat16, num_hidden_layers=layers
    )


def train_config(objective: str, device: torch.device, smoke: bool):  # type: ignore[no-untyped-def]
    from blockdraft.training.config import load_config

    edr = objective == "edr"
    path = ROOT / "configs" / ("dflash-qwen3-8b-edr.yaml" if edr else "dflash-qwen3-8b.yaml")
    keys: dict[str, object] = {
        "data.train_rollouts": "synthetic",
        "data.eval_split": 0,
        "optim.batch_size": 1,  # one sequence per GPU, as the recipe's 8-GPU run
        "optim.grad_accum": 1,
        "device": device.type,
    }
    if edr:
        keys.update({"drafter.init_from": "null", "objective.mode": "sampling"})
    if objective == "e2e":
        keys["objective.name"] = "e2e"
    if smoke:
        keys.update(SMOKE_TRAIN)
    return path, load_config(path, [f"{k}={v}" for k, v in keys.items()])


def drafter_step_flops(cfg, hf, prompt_len: int, seq_len: int, trained: int, scored: int) -> float:  # type: ignore[no-untyped-def]
    """Model FLOPs of one drafter step: matmuls and unmasked attention, forward x3 for the
    trained weights (forward, input and weight gradients), x2 for the frozen LM head (no
    weight gradient), x3.5 for attention (its backward is ~2.5 forwards); `trained` blocks
    carry gradient, `scored` more blocks run forward only (EDR's scoring pass)."""
    c = getattr(hf, "text_config", None) or hf
    H, ffn, V = c.hidden_size, c.intermediate_size, c.vocab_size
    hd = getattr(c, "head_dim", None) or H // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layers, Kb = cfg.drafter.num_layers, cfg.drafter.block_size
    features = 5 * H  # DFlash's 5 feature layers
    ctx = (prompt_len + seq_len) / 2  # anchors spread over the response

    def forward(blocks: int) -> tuple[float, float, float]:
        rows = blocks * Kb
        trained_mm = layers * 2 * rows * (H * q + 2 * H * kv + q * H + 3 * H * ffn)
        head = 2 * blocks * (Kb - 1) * H * V
        attention = layers * 4 * rows * (ctx + Kb) * hd * c.num_attention_heads
        return trained_mm, head, attention

    context = 2 * seq_len * features * H + layers * 2 * seq_len * H * 2 * kv
    mm, head, att = forward(trained)
    total = 3 * (mm + context) + 2 * head + 3.5 * att
    smm, shead, satt = forward(scored)
    return total + smm + shead + satt + (context if scored else 0)


def part_train(
    part: Part, device: torch.device, smoke: bool, objective: str, layers: int, work: Path
) -> None:
    from blockdraft.data.rollouts.sampler import SamplingSettings
    from blockdraft.training.batching import collate
    from blockdraft.training.loop import train_step
    from blockdraft.training.memory_plan import plan_memory
    from blockdraft.training.synthetic import random_rollouts, synthetic_run

    path, cfg = train_config(objective, device, smoke)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    target = shaped_target(device, smoke, layers)
    hf = target.model.config
    T = cfg.data.max_seq_len
    prompt = T // 6
    sampled = objective != "dpace"
    settings = SamplingSettings(temperature=1.0 if sampled else 0.0)
    rollouts = random_rollouts(1, prompt, T - prompt, hf.vocab_size, seed=1)
    parts = synthetic_run(cfg, target, rollouts, settings, device)
    part.record(
        config=str(path.relative_to(ROOT)),
        target=f"random Qwen3-8B shape, {hf.num_hidden_layers} of {FULL_TARGET_LAYERS} layers"
        if not smoke
        else f"random tiny Qwen3 ({SMOKE_TARGET['hidden_size']} wide)",
        seq_len=T,
        anchors=cfg.objective.max_anchors if objective == "edr" else cfg.num_anchors,
        drafter_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        amp=str(parts.amp_dtype),
        attention="flex" if device.type == "cuda" else "tiled",
    )
    plan = plan_memory(cfg, 1, device.type, hf_config=hf)
    part.record(plan_gib=plan.peak / GiB)
    if not smoke:
        from transformers import Qwen3Config

        from fixture_targets import SHAPES

        full = plan_memory(cfg, 1, "cuda", hf_config=Qwen3Config(**SHAPES["qwen3-8b"][1]))
        part.record(plan_full_target_gib=full.peak / GiB)
    warm, reps = (1, 1) if smoke else (2, 3)
    times: list[float] = []
    first_s = None
    for step in range(warm + reps):
        sync(device)
        t0 = time.perf_counter()
        metrics = train_step(parts, step, want_acc=False)
        sync(device)
        dt = time.perf_counter() - t0
        first_s = dt if first_s is None else first_s
        if step >= warm:
            times.append(dt)
        part.record(first_step_s=first_s, step_times_s=times)
        if device.type == "cuda":  # after each step: a part killed later still has it
            part.record(peak_gib=torch.cuda.max_memory_allocated(device) / GiB)
    step_s = statistics.median(times)
    tokens = metrics["tokens"]
    part.record(
        step_s=step_s, tokens_per_step=tokens, tokens_per_s=tokens / step_s, loss=metrics["loss"]
    )
    # the target forward alone, as the step runs it (logits of the response when sampled)
    ids = collate(rollouts, [0], parts.pad_id, T).to(device).input_ids
    keep = T - prompt if sampled else 0

    def target_forward() -> None:
        target.forward(ids, with_logits=sampled, logits_to_keep=keep)

    amp = (
        torch.autocast(device.type, dtype=parts.amp_dtype)
        if parts.amp_dtype
        else contextlib.nullcontext()
    )
    with torch.no_grad(), amp:
        target_s = statistics.median(timed(target_forward, device) for _ in range(3))
    layers_used = hf.num_hidden_layers
    if not smoke:  # estimated: each missing target layer costs what a measured one does
        extra = target_s * (FULL_TARGET_LAYERS / layers_used - 1)
        part.record(step_full_target_s_estimated=step_s + extra)
    starts = T - prompt - 1
    trained = (
        min(cfg.objective.max_anchors, starts)
        if objective == "edr"
        else min(cfg.num_anchors, starts)
    )
    scored = starts if objective == "edr" and cfg.objective.anchor_sampler != "uniform" else 0
    flops = drafter_step_flops(cfg, hf, prompt, T, trained, scored)
    rate = _matmul_flops(work, device, smoke)
    drafter_s = max(step_s - target_s, 1e-9)
    part.record(
        target_forward_s=target_s,
        drafter_step_s=drafter_s,
        drafter_model_flops=flops,
        drafter_tflops_per_s=flops / drafter_s / 1e12,
        matmul_flops=rate,
        drafter_mfu=flops / drafter_s / rate,
    )


def _matmul_flops(work: Path, device: torch.device, smoke: bool) -> float:
    """The `matmul` part's rate when it ran, else measured here."""
    try:
        data = json.loads((work / "matmul.json").read_text())
        if data["status"] == "ok":
            return float(data["numbers"]["matmul_flops"])
    except (OSError, KeyError, ValueError):
        pass
    return matmul_rate(device, smoke)["matmul_flops"]


# --- rollouts and decoding ------------------------------------------------------------------
def part_rollout(part: Part, device: torch.device, smoke: bool, layers: int) -> None:
    from blockdraft.data.rollouts.sampler import SamplingSettings
    from rollout import make_prompts, run_hf, run_ours

    target = shaped_target(device, smoke, layers)
    batch, new = (8, 8) if smoke else (32, 128)
    prompts = make_prompts(batch)
    s = SamplingSettings(temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=new, seed=0)
    warm = SamplingSettings(temperature=1.0, max_new_tokens=2)
    run_ours(target, prompts, warm, batch)
    run_hf(target, prompts, warm, batch)
    part.record(batch=batch, new_tokens=new, prompts=len(prompts))
    ours, hf = [], []
    for r in range(2):
        for side in ("ours", "hf") if r == 0 else ("hf", "ours"):
            n_tok, dt = (run_ours if side == "ours" else run_hf)(target, prompts, s, batch)
            (ours if side == "ours" else hf).append(n_tok / dt)
        part.record(rollout_tokens_per_s=max(ours), hf_generate_tokens_per_s=max(hf))
    part.record(rollout_vs_hf=max(ours) / max(hf))


def part_decode(part: Part, device: torch.device, smoke: bool, layers: int) -> None:
    from blockdraft.decoding.hf_generate import ar_vs_hf
    from blockdraft.decoding.loop import decode
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    target = shaped_target(device, smoke, layers)
    n, length, new = (2, 16, 16) if smoke else (4, 64, 128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(n)]
    part.record(prompts=n, prompt_tokens=length, new_tokens=new)
    part.record(**ar_vs_hf(target, prompts, temperature=0.0, max_new_tokens=new))
    cfg = DrafterConfig.for_target(target, num_layers=1 if smoke else 5, block_size=16)
    torch.manual_seed(0)
    drafter = BlockDrafter(cfg).bind_target(target).to(device, target.model.dtype).eval()
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=new)
    costs = res.round_costs()
    part.record(
        drafter_layers=cfg.num_hidden_layers,
        spec_tokens_per_s=res.tokens_per_s,
        spec_ar_tokens_per_s=res.ar_tokens_per_s,
        ar_step_s=res.ar_step_s,
        round_s=sum(costs.values()),
        round_costs_s=costs,
        round_cost_ar_steps=sum(costs.values()) / res.ar_step_s,
        draft_cost_ar_steps=costs.get("draft", 0.0) / res.ar_step_s,
        tau=res.tau,
    )


# --- summary --------------------------------------------------------------------------------
def _tests(work: Path, log: Path | None) -> dict:
    """tests/gpu's outcome: the JUnit report, or (pytest killed at its limit) the
    per-test lines `pytest -v` had written to the log."""
    xml = work / "tests.xml"
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        failed = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
        n, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        return {"status": "ok", "passed": n - len(failed) - skipped, "failed": failed,
                "skipped": skipped}  # fmt: skip
    lines = log.read_text(errors="replace").splitlines() if log and log.is_file() else []
    seen = [ln.split() for ln in lines if ln.startswith("tests/gpu/") and "::" in ln]
    outcome = {w[0]: w[1] for w in seen if len(w) > 1}
    if not outcome:
        return {"status": "no report (not run, or killed before its first test)"}
    failed = [t for t, o in outcome.items() if o in ("FAILED", "ERROR")]
    return {
        "status": "killed at its limit: tests after the last listed did not run",
        "passed": sum(o == "PASSED" for o in outcome.values()),
        "failed": failed,
        "skipped": sum(o == "SKIPPED" for o in outcome.values()),
    }


def _fmt(x: object, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def summary(work: Path, out: Path, total_s: float | None) -> int:
    parts = {}
    for name in PARTS:
        try:
            parts[name] = json.loads((work / f"{name}.json").read_text())
        except (OSError, ValueError):
            parts[name] = {"part": name, "status": "not run", "numbers": {}}
    tests = _tests(work, out / "gpu_check.log")
    num = {k: v["numbers"] for k, v in parts.items()}
    rows: list[dict] = []

    def row(
        check: str,
        measured: str,
        reference: str = "",
        goal: str = "",
        met: bool | None = None,
        part: str = "",
    ) -> None:
        status = parts[part]["status"] if part else "ok"
        rows.append(
            {
                "check": check,
                "measured": measured,
                "reference": reference,
                "goal": goal,
                "met": met,
                "status": status,
            }
        )

    if "passed" in tests:
        counts = (
            f"{tests['passed']} passed, {len(tests['failed'])} failed, {tests['skipped']} skipped"
        )
        note = "; ".join(tests["failed"])[:300] if tests["status"] == "ok" else tests["status"]
        row("tests/gpu", counts, note, "all pass", tests["status"] == "ok" and not tests["failed"])
    else:
        row("tests/gpu", tests["status"], "", "all pass", False)
    m = num["matmul"]
    row(
        f"matmul [{_fmt(m.get('matmul_n'))}]^3 {m.get('matmul_dtype', '')}",
        f"{_fmt(m.get('matmul_flops') and m['matmul_flops'] / 1e12)} TFLOP/s",
        "",
        "",
        None,
        "matmul",
    )
    names = {"dpace": "D-PACE recipe step", "edr": "EDR sampling step", "e2e": "E2E sampling step"}
    for key, label in names.items():
        n = num[key]
        shape = (
            f"{n.get('drafter_layers')} layers, block {n.get('block_size')}, "
            f"{n.get('anchors')} anchors, T {n.get('seq_len')}, {n.get('target')}"
        )
        peak, plan = n.get("peak_gib"), n.get("plan_gib")
        ratio = plan / peak if peak and plan else None
        row(
            f"{label}: step time ({shape})",
            f"{_fmt(n.get('step_s'))} s, {_fmt(n.get('tokens_per_s'))} tok/s",
            f"first step {_fmt(n.get('first_step_s'))} s, "
            f"target fwd {_fmt(n.get('target_forward_s'))} s; with all 36 target layers "
            f"{_fmt(n.get('step_full_target_s_estimated'))} s (estimated)",
            part=key,
        )
        row(
            f"{label}: peak memory vs --plan",
            f"{_fmt(peak)} GiB" if peak else "not measured on CPU",
            f"plan {_fmt(plan)} GiB "
            f"(ratio {_fmt(ratio)}; "
            f"full 36 layers: plan {_fmt(n.get('plan_full_target_gib'))} GiB)",
            "plan within 20%",
            None if ratio is None else 0.8 <= ratio <= 1.2,
            key,
        )
        mfu = n.get("drafter_mfu")
        row(
            f"{label}: drafter MFU vs matmul",
            f"{_fmt(mfu and 100 * mfu, '.1f')}%",
            f"{_fmt(n.get('drafter_tflops_per_s'))} TFLOP/s of model FLOPs",
            ">= 35%" if key == "dpace" else "",
            None if mfu is None or key != "dpace" else mfu >= 0.35,
            key,
        )
    d, e = num["dpace"].get("step_s"), num["edr"].get("step_s")
    if d and e:
        row(
            "EDR step / D-PACE step",
            f"{e / d:.2f}x",
            f"{_fmt(num['edr'].get('anchors'))} round starts with gradient + the scoring pass "
            f"vs {_fmt(num['dpace'].get('anchors'))} anchors",
            "<= 1.3x",
            e / d <= 1.3,
            "edr",
        )
    r = num["rollout"]
    row(
        f"rollout vs HF generate, batch {_fmt(r.get('batch'))}",
        f"{_fmt(r.get('rollout_tokens_per_s'))} vs {_fmt(r.get('hf_generate_tokens_per_s'))} tok/s",
        f"ratio {_fmt(r.get('rollout_vs_hf'))}",
        ">= 1",
        None if r.get("rollout_vs_hf") is None else r["rollout_vs_hf"] >= 1,
        "rollout",
    )
    c = num["decode"]
    row(
        "AR loop vs HF generate, batch 1",
        f"{_fmt(c.get('ar_tokens_per_s'))} vs {_fmt(c.get('hf_tokens_per_s'))} tok/s",
        f"ratio {_fmt(c.get('ar_vs_hf'))}",
        ">= 1",
        None if c.get("ar_vs_hf") is None else c["ar_vs_hf"] >= 1,
        "decode",
    )
    row(
        f"drafter round ({_fmt(c.get('drafter_layers'))} layers, block 16) in AR steps",
        f"{_fmt(c.get('round_cost_ar_steps'))} AR steps",
        f"draft alone {_fmt(c.get('draft_cost_ar_steps'))}; "
        f"AR step {_fmt(c.get('ar_step_s') and 1e3 * c['ar_step_s'])} ms",
        "",
        None,
        "decode",
    )
    if total_s is not None:
        row("total wall-clock of the script", f"{total_s:.0f} s", "", "< 480 s", total_s < 480)
    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    smoke = any(p.get("smoke") for p in parts.values())
    result = {
        "env": env,
        "smoke": smoke,
        "tests": tests,
        "parts": parts,
        "rows": rows,
        "total_s": total_s,
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    title = "GPU check" + (" (CPU SMOKE: tiny shapes, numbers mean nothing)" if smoke else "")
    where = f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']})"
    print(f"\n{title}: {where}, {env['date_utc']} UTC")
    print("| check | measured | next to | goal | met | part |")
    print("|---|---|---|---|---|---|")
    for x in rows:
        met = {True: "yes", False: "NO", None: ""}[x["met"]]
        cells = [x["check"], x["measured"], x["reference"], x["goal"], met, x["status"]]
        print("| " + " | ".join(cells) + " |")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=(*PARTS, "summary", "preflight"), required=True)
    p.add_argument("--work", type=Path, required=True, help="folder of the parts' JSON")
    p.add_argument("--out", type=Path, default=None, help="summary: where gpu_check.json goes")
    p.add_argument("--total-s", type=float, default=None, help="summary: the script's wall time")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--target-layers", type=int, default=8, help="decoder layers of the 8B shape")
    args = p.parse_args()
    if args.part == "preflight":
        if not args.cpu_smoke and not torch.cuda.is_available():
            print(
                f"error: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() "
                "is False): this check measures a GPU; `bash scripts/gpu_check.sh --cpu-smoke` "
                "dry-runs it on the CPU",
                file=sys.stderr,
            )
            return 2
        return 0
    if args.part == "summary":
        return summary(args.work, args.out or args.work, args.total_s)
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if args.cpu_smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    from blockdraft.threads import flush_denormals

    flush_denormals()  # as `blockdraft train` runs
    part = Part(args.work, args.part, args.cpu_smoke)
    try:
        if args.part == "matmul":
            part_matmul(part, device, args.cpu_smoke)
        elif args.part in ("dpace", "edr", "e2e"):
            part_train(part, device, args.cpu_smoke, args.part, args.target_layers, args.work)
        elif args.part == "rollout":
            part_rollout(part, device, args.cpu_smoke, args.target_layers)
        else:
            part_decode(part, device, args.cpu_smoke, args.target_layers)
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised for the log
        part.data.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        part.save()
        raise
    part.data["status"] = "ok"
    part.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
