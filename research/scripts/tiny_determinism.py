"""Which kernel choices change the `tiny` build and its greedy rollouts (research/results.md,
"The tiny target", "Across CPUs").

    python research/scripts/tiny_determinism.py builds              # micro builds under ISA caps
    python research/scripts/tiny_determinism.py rollouts --target tiny   # same weights, rollouts
    python research/scripts/tiny_determinism.py speed               # what the fixes would cost

`builds` runs a 60-step micro build of `tiny` (the real code path) in a child process per
setting and prints its weights' hash and held-out loss: a setting that changes the hash
changes the real build too. Settings are environment variables read when torch / MKL /
oneDNN start, hence the child processes: ATen's vector ISA (`ATEN_CPU_CAPABILITY`), MKL's
instruction set and its reproducible code branch (`MKL_ENABLE_INSTRUCTIONS`, `MKL_CBWR`),
oneDNN's ISA (`ONEDNN_MAX_CPU_ISA`). `rollouts` generates greedy held-out rollouts with the
*same* weights under the same caps, one thread vs two, batch 16 vs 1, and counts the
rollouts whose tokens differ from the default run's. `speed` times a `tiny` training step
in fp32 and under bf16 autocast (interleaved), and one training-sized product under the
settings above.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SETTINGS = {
    "default": {},
    "aten avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "onednn avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "aten + mkl avx2": AVX2,
    "mkl cbwr compatible": {"MKL_CBWR": "COMPATIBLE"},
    "aten default + mkl compatible": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}


def _child(env: dict[str, str], *args: str) -> str:
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def micro_build(precision: str) -> None:
    """(child) one micro build in a temporary cache: print hash and held-out loss."""
    import torch
    from safetensors.torch import load_file

    from blockdraft.targets.tiny import TinyConfig, build_tiny_target, read_manifest

    with tempfile.TemporaryDirectory() as d:
        config = TinyConfig.micro(precision=precision, steps=60)
        path = build_tiny_target(config, cache_dir=d, progress=False, num_threads=1)
        weights = load_file(path / "model.safetensors")
        blob = b"".join(weights[k].numpy().tobytes() for k in sorted(weights))
        loss = read_manifest(path)["final_heldout_loss"]
        cap = torch.backends.cpu.get_cpu_capability()
        print(f"{hashlib.sha256(blob).hexdigest()[:16]}  loss {loss:.9f}  ATen {cap}")


def rollouts(target: str, out: Path, threads: int, batch: int) -> None:
    """(child) 64 greedy stdlib:eval rollouts x 128 tokens; print one hash per rollout."""
    import torch

    from blockdraft.data.prompt_specs import load_prompts
    from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
    from blockdraft.targets.registry import load_target

    torch.set_num_threads(threads)
    model = load_target(target)
    sampling = SamplingSettings(temperature=0.0, max_new_tokens=128, seed=0)
    rs = generate_rollouts(
        model, load_prompts("stdlib:eval", limit=64), out, sampling, batch_size=batch
    )
    print(" ".join(hashlib.sha256(r.response_ids.numpy().tobytes()).hexdigest()[:8] for r in rs))


def step_speed() -> None:
    """(child) ms per `tiny` training step, fp32 vs bf16 autocast, interleaved, 1 thread."""
    import time

    import torch
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockdraft.targets.tiny import TinyConfig

    torch.set_num_threads(1)
    c = TinyConfig()
    cfg = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.hidden_size // c.num_heads,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = torch.randint(0, c.vocab_size, (c.batch_size, c.seq_len + 1))

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=w[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    took = {False: 0.0, True: 0.0}
    for bf16 in (False, True):
        step(bf16)
    for _ in range(6):
        for bf16 in (False, True):
            t0 = time.perf_counter()
            for _ in range(5):
                step(bf16)
            took[bf16] += time.perf_counter() - t0
    print(f"fp32 {1e3 * took[False] / 30:.0f} ms/step, bf16 autocast {1e3 * took[True] / 30:.0f}")


def product_speed() -> None:
    """(child) us per 1024 x 128 x 384 fp32 product and per SiLU of its output, 1 thread."""
    import time

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x, w = torch.randn(1024, 128), torch.randn(384, 128)
    y = F.linear(x, w)

    def us(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(10):
            fn()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        return 1e6 * (time.perf_counter() - t0) / 200

    print(f"product {us(lambda: F.linear(x, w)):.0f} us, silu {us(lambda: F.silu(y)):.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "what", choices=["builds", "rollouts", "speed", "_build", "_rollouts", "_step", "_product"]
    )
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.what == "_build":
        return micro_build(args.precision)
    if args.what == "_rollouts":
        return rollouts(args.target, Path(args.out), args.threads, args.batch)
    if args.what == "_step":
        return step_speed()
    if args.what == "_product":
        return product_speed()
    if args.what == "speed":
        print(f"training step: {_child({}, '_step')}")
        for name, env in SETTINGS.items():
            print(f"{name:<32} {_child(env, '_product')}")
        return None
    if args.what == "builds":
        for name, env in SETTINGS.items():
            print(f"{name:<32} {_child(env, '_build', '--precision', args.precision)}")
        return None
    runs = {
        "default": ({}, 1, 16),
        "aten + mkl avx2": (AVX2, 1, 16),
        "2 threads": ({}, 2, 16),
        "batch 1": ({}, 1, 1),
    }
    with tempfile.TemporaryDirectory() as d:
        hashes = {}
        for name, (env, threads, batch) in runs.items():
            extra = ["--threads", str(threads), "--batch", str(batch), "--target", args.target]
            line = _child(env, "_rollouts", "--out", f"{d}/{len(hashes)}", *extra)
            hashes[name] = line.split()
        base = hashes["default"]
        for name, h in hashes.items():
            diff = sum(a != b for a, b in zip(base, h, strict=True))
            print(f"{name:<20} {diff}/{len(h)} rollouts differ from the default run")
    return None


if __name__ == "__main__":
    main()
