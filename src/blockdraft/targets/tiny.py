"""The embedded default target `tiny`: a small Qwen3 LM that blockdraft trains itself.

Why: the demo and the tests need a *trained* target without any download. blockdraft
trains a small Qwen3 model with its own BPE on the Python standard library's source
(`build_tiny_target`, minutes on a CPU, cached by a key over `TinyConfig` and the corpus).
The default build ships in the package (`tiny_weights/`, checksummed): the same weights on
every machine, since the CPU's vector ISA and the Python version's stdlib change a local
build's (research/results.md, "The tiny target"). Other configs build on first use.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import blockdraft
from blockdraft.artifacts import listed_file
from blockdraft.errors import BlockdraftError
from blockdraft.targets.target import Target
from blockdraft.targets.tiny_corpus import Corpus, load_corpus, pack_documents, windows
from blockdraft.targets.tokenizer import EOS_TOKEN, MASK_TOKEN, train_bpe_tokenizer
from blockdraft.threads import idle_cores
from blockdraft.user_cache import (
    atomic_directory,
    read_json,
    stable_hash,
    targets_dir,
    write_json,
)

MANIFEST = "blockdraft_manifest.json"
FORMAT_VERSION = 1  # bump when the build procedure changes in a way that alters weights
SHIPPED_DIR = Path(__file__).with_name("tiny_weights")  # the default build, in the package
CHECKSUMS = "SHA256SUMS"  # sha256 of every shipped file, `sha256sum` format


@dataclass(frozen=True)
class TinyConfig:
    """Everything that determines the built model (all of it enters the cache key)."""

    vocab_size: int = 4096
    # Narrow and fed many tokens rather than wide and fed few: at equal CPU wall time width
    # 128 reached a lower held-out loss than 192 or 256, and halves the drafter's cost.
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    # Short windows and small batches: at a ~1M-token budget more optimizer steps beat
    # longer contexts (and lr 3e-3 beat 1e-2); 8 x 128 keeps 2 threads busy. Both measured
    # in research/results.md, "The tiny target".
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 2600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    max_chars: int | None = None  # cap on corpus characters (None: all top-level stdlib)
    heldout_every: int = 20  # every n-th file (sorted by name) is held out
    eval_windows: int = 32
    eval_seq_len: int = 256  # held-out loss on windows as long as demo rollouts (prompt + 128)
    # fp32 everywhere: bf16 autocast where the CPU has it made the same config build
    # different models on different CPUs, and is no faster at this width (research/results.md)
    precision: str = "fp32"  # or "bf16" (autocast)

    @classmethod
    def micro(cls, seed: int = 0, **overrides: Any) -> TinyConfig:
        """A seconds-long build through the same code path, for tests."""
        base = dict(
            vocab_size=320,
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            max_position_embeddings=256,
            seq_len=64,
            eval_seq_len=64,
            batch_size=8,
            steps=20,
            lr=1e-2,
            warmup_steps=3,
            max_chars=40_000,
            heldout_every=4,
            eval_windows=8,
            seed=seed,
        )
        base.update(overrides)
        return cls(**base)


def cache_key(config: TinyConfig, corpus_digest: str) -> str:
    return stable_hash(
        {"config": asdict(config), "corpus": corpus_digest, "format": FORMAT_VERSION}
    )


def tiny_target_path(config: TinyConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """Where the target for `config` lives (whether or not it has been built yet): the
    shipped weights for the default (`config=None`), else the cache's build."""
    if config is None and shipped_tiny_path() is not None:
        return SHIPPED_DIR
    config = config or TinyConfig()
    corpus = load_corpus(config.max_chars, config.heldout_every)
    return targets_dir(cache_dir) / f"tiny-{cache_key(config, corpus.digest)[:16]}"


def shipped_tiny_path() -> Path | None:
    """The shipped default build, or None when the package holds none for today's
    `TinyConfig()` (its defaults changed and the weights were not rebuilt)."""
    if not is_built(SHIPPED_DIR):
        return None
    manifest = read_manifest(SHIPPED_DIR)
    return SHIPPED_DIR if manifest.get("config") == asdict(TinyConfig()) else None


def verify_shipped(path: Path = SHIPPED_DIR) -> None:
    """Refuse shipped files that differ from their checksums (a truncated checkout, an
    edited file): the target's fingerprint would change and every cached stage with it."""
    sums = path / CHECKSUMS
    if not sums.is_file():
        raise BlockdraftError(f"{sums}: missing; the shipped tiny target cannot be verified")
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        file = listed_file(path, name, sums, BlockdraftError)
        got = _sha256(file) if file.is_file() else "missing"
        if got != digest:
            raise BlockdraftError(
                f"{file}: sha256 {got[:16]} != {digest[:16]} in {CHECKSUMS}; "
                "reinstall blockdraft or rebuild with `blockdraft target build tiny`"
            )


def write_checksums(path: Path) -> None:
    """`SHA256SUMS` over every file of a build directory (what `verify_shipped` checks)."""
    names = sorted(f.name for f in path.iterdir() if f.is_file() and f.name != CHECKSUMS)
    (path / CHECKSUMS).write_text("".join(f"{_sha256(path / n)}  {n}\n" for n in names))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_built(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def build_tiny_target(
    config: TinyConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    num_threads: int | None = None,
) -> Path:
    """Build (or find in the cache) the `tiny` target; return its HF directory. An
    interrupted build leaves nothing that looks finished (`atomic_directory`)."""
    config = config or TinyConfig()
    _check_config(config)
    corpus = load_corpus(config.max_chars, config.heldout_every)
    key = cache_key(config, corpus.digest)
    final = targets_dir(cache_dir) / f"tiny-{key[:16]}"
    if is_built(final):
        return final
    if final.exists():  # not produced by us (no manifest): never trust it
        shutil.rmtree(final)
    with atomic_directory(final) as tmp:
        _build_into(tmp, config, corpus, key, progress, num_threads or build_threads())
    return final


def load_tiny_target(
    config: TinyConfig | None = None,
    *,
    cache_dir: str | Path | None = None,
    layer_ids: list[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Target:
    """Load the `tiny` target: the shipped weights for the default (`config=None`), else
    the cached build of `config`, building it first if it is missing."""
    # lazy: transformers takes seconds to import; `targets.registry` imports this module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shipped_tiny_path() if config is None else None
    if path is not None:
        verify_shipped(path)
    else:
        path = build_tiny_target(config, cache_dir=cache_dir, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return Target(
        model,
        tokenizer,
        name="tiny",
        mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        layer_ids=layer_ids,
        stop_token_ids=[tokenizer.convert_tokens_to_ids(EOS_TOKEN)],
    )


# --- the build ------------------------------------------------------------------------
def _check_config(c: TinyConfig) -> None:
    if c.hidden_size % c.num_heads or c.num_heads % c.num_kv_heads:
        raise ValueError(
            "tiny config: hidden_size must divide by num_heads, num_heads by num_kv_heads"
        )
    if c.vocab_size < 260:
        raise ValueError(f"tiny config: vocab_size {c.vocab_size} < 260 (256 bytes + specials)")
    if c.precision not in ("bf16", "fp32"):
        raise ValueError(f"tiny config: precision {c.precision!r} is not fp32 or bf16")
    if max(c.seq_len, c.eval_seq_len) > c.max_position_embeddings:
        raise ValueError("tiny config: seq_len or eval_seq_len exceeds max_position_embeddings")


def _make_model(c: TinyConfig, tokenizer) -> torch.nn.Module:
    # lazy: transformers takes seconds to import; only a build needs it
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.hidden_size // c.num_heads,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    torch.manual_seed(c.seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, data: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (fp32) over `[N, S+1]` windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        w = data[i : i + batch_size]
        logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def _lr_factor(step: int, c: TinyConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < c.warmup_steps:
        return (step + 1) / c.warmup_steps
    frac = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def _train(model, train: torch.Tensor, c: TinyConfig, progress: bool) -> list[float]:
    """AdamW on shuffled packed windows (seeded order); returns per-step losses."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": c.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=c.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, c))
    gen = torch.Generator().manual_seed(c.seed)
    order = torch.empty(0, dtype=torch.long)
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(c.steps), desc="training tiny target", disable=not progress, unit="step")
    for step in bar:
        if len(order) < c.batch_size:
            order = torch.cat([order, torch.randperm(len(train), generator=gen)])
        idx, order = order[: c.batch_size], order[c.batch_size :]
        w = train[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.precision == "bf16"):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"tiny target build: loss became {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tok_s = (step + 1) * w[:, 1:].numel() / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:.0f}")
    return losses


def build_threads(window_s: float = 0.3) -> int:
    """torch's thread count, reduced to the cores idle *right now*: two threads on cores
    shared with another busy process were seen 5-10x slower than one. The count changes
    the last bits of the default build's weights (not the micro build's: MKL splits only
    large products), which is one reason the default ships."""
    n = torch.get_num_threads()
    idle = idle_cores(window_s)
    return n if idle is None else min(n, idle)


def _build_into(
    out: Path, c: TinyConfig, corpus: Corpus, key: str, progress: bool, num_threads: int
) -> None:
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    timings: dict[str, float] = {}
    try:
        chars = f"{corpus.num_chars:,} chars of stdlib"
        if progress:
            print(
                f"[blockdraft] {num_threads} thread(s); training a {c.vocab_size}-token BPE "
                f"on {chars} ...",
                file=sys.stderr,
                flush=True,
            )
        tokenizer = train_bpe_tokenizer(corpus.train_texts, vocab_size=c.vocab_size)
        timings["tokenizer_s"] = round(time.perf_counter() - t0, 2)
        eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        train = windows(pack_documents(tokenizer, corpus.train_texts, eos), c.seq_len)
        held = windows(pack_documents(tokenizer, corpus.heldout_texts, eos), c.eval_seq_len)
        tokenizer.model_max_length = c.max_position_embeddings  # after packing whole files
        timings["tokenize_s"] = round(time.perf_counter() - t0 - timings["tokenizer_s"], 2)
        held = held[: c.eval_windows]
        train_eval = train[
            torch.linspace(0, len(train) - 1, min(c.eval_windows, len(train))).long()
        ]
        model = _make_model(c, tokenizer)
        initial = evaluate_loss(model, held)
        t_train = time.perf_counter()
        losses = _train(model, train, c, progress)
        timings["train_s"] = round(time.perf_counter() - t_train, 2)
        final_held, final_train = evaluate_loss(model, held), evaluate_loss(model, train_eval)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # lazy: transformers takes seconds to import; only a build needs it
    import transformers

    write_json(
        out / MANIFEST,
        {
            "name": "tiny",
            "cache_key": key,
            "config": asdict(c),
            "seed": c.seed,
            "precision_used": c.precision,
            "corpus": {
                "root": str(corpus.root),
                "digest": corpus.digest,
                "chars": corpus.num_chars,
                "train_files": corpus.train_files,
                "heldout_files": corpus.heldout_files,
                "train_tokens": int(train.numel()),
                "heldout_tokens": int(held.numel()),
            },
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "tokens_seen": c.steps * c.batch_size * c.seq_len,
            "initial_heldout_loss": initial,
            "final_heldout_loss": final_held,
            "final_train_loss": final_train,
            "last_step_loss": losses[-1],
            "build_seconds": round(time.perf_counter() - t0, 2),
            "timings": timings,
            "torch_threads": num_threads,
            # what sets the last bits of every product (research/results.md, "The tiny target")
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_model": _cpu_model(),
            "python_version": platform.python_version(),
            "platform": f"{sys.platform}-{platform.machine()}",
            "cpu_count": os.cpu_count(),
            "blockdraft_version": blockdraft.__version__,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        },
    )


def _cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def read_manifest(path: str | Path) -> dict[str, Any]:
    return read_json(Path(path) / MANIFEST)
