"""Per-GPU memory of a training config, from the HF config alone (`blockdraft train --plan`).

Why: a run that does not fit should know before loading an 8B target on every rank. Each
term counts the tensors the code creates (not a fit; tests check it against live tensor
bytes). Peak = persistent (weights, grads, optimizer) + max(target forward, drafter step)
per micro-batch of `max_seq_len` sequences; what is counted: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockdraft.drafters.block_attention import TILE_QUERIES
from blockdraft.objectives.cross_entropy import (
    DEFAULT_CHUNK_ELEMENTS,
    MAX_KEPT_PROBS_BYTES,
    default_chunk_rows,
)
from blockdraft.targets.target import default_layer_ids
from blockdraft.targets.tiny import TinyConfig
from blockdraft.training.config import drafted_blocks

GiB = 1 << 30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryPlan:
    """Bytes per GPU by component; `peak` is what must fit in the device."""

    device: str
    world_size: int
    micro_batch: int
    parts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    grads_persist: bool = False  # gradient accumulation: grads live through the next forward

    @property
    def persistent(self) -> int:
        keys = ["target_weights", "drafter_weights", "optimizer", "extra_copies"]
        if self.grads_persist:
            keys.append("drafter_grads")
        return sum(self.parts[k] for k in keys)

    @property
    def peak(self) -> int:
        return self.persistent + max(self.parts["target_forward"], self.parts["drafter_step"])

    def fits(self, device_bytes: float) -> bool:
        return self.peak <= device_bytes

    def render(self, device_gb: float | None = None) -> str:
        """The table `blockdraft train --plan` prints (GiB)."""
        labels = {
            "target_weights": "target weights",
            "drafter_weights": "drafter weights (fp32)",
            "drafter_grads": "drafter gradients (fp32)",
            "optimizer": "AdamW state (fp32)",
            "extra_copies": "DDP bucket / autocast / FSDP copies",
            "target_forward": "target forward activations (no grad)",
            "drafter_activations": "  drafter activations (kept for backward)",
            "drafter_attention": "  drafter attention",
            "cross_entropy": "  vocabulary buffers (CE / E2E / EDR)",
            "drafter_step": "drafter step (forward+backward)",
        }
        lines = [
            f"memory plan per GPU: device {self.device}, world size {self.world_size}, "
            f"{self.micro_batch} sequence(s) per micro-batch"
        ]
        for key, label in labels.items():
            lines.append(f"  {label:<42} {self.parts[key] / GiB:9.2f} GiB")
        lines.append(
            f"  {'peak = persistent + max(target fwd, step)':<42} {self.peak / GiB:9.2f} GiB"
        )
        if not self.grads_persist:
            lines.append(
                "  (gradients are created during backward as activations are freed: not in"
            )
            lines.append("   the persistent part; with optim.grad_accum > 1 they are)")
        if device_gb is not None:
            verdict = "fits" if self.fits(device_gb * 1e9) else "does NOT fit"
            lines.append(f"  {verdict} in {device_gb:g} GB")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass
class _Shapes:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool
    layer_ids: list[int]


def _shapes(hf: Any, layer_ids: list[int] | None) -> _Shapes:
    c = getattr(hf, "text_config", None) or hf
    heads = int(c.num_attention_heads)
    layers = int(c.num_hidden_layers)
    return _Shapes(
        vocab=int(c.vocab_size),
        hidden=int(c.hidden_size),
        intermediate=int(c.intermediate_size),
        layers=layers,
        heads=heads,
        kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads),
        tied=bool(getattr(hf, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False))),
        qk_norm="qwen3" in str(getattr(c, "model_type", ""))
        or "gemma3" in str(getattr(c, "model_type", "")),
        layer_ids=list(layer_ids) if layer_ids is not None else default_layer_ids(layers),
    )


def _layer_params(s: _Shapes, qk_norm: bool) -> int:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = s.hidden * q * 2 + s.hidden * kv * 2 + (2 * s.head_dim if qk_norm else 0)
    return attn + 3 * s.hidden * s.intermediate + 2 * s.hidden


def hf_config_for(name: str, trust_remote_code: bool = False) -> Any:
    """The target's HF config without its weights (`tiny`: built from `TinyConfig`)."""
    # lazy: transformers takes seconds to import; only `--plan` needs it
    from transformers import AutoConfig, Qwen3Config

    if name == "tiny":
        c = TinyConfig()
        return Qwen3Config(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.hidden_size // c.num_heads,
            tie_word_embeddings=True,
        )
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"target.name: no readable HF config for {name!r} ({first})") from exc


def plan_memory(
    cfg: Any, world_size: int = 1, device: str = "cuda", hf_config: Any = None
) -> MemoryPlan:
    """Per-GPU memory of training `cfg` on `world_size` devices; `device` ("cuda" or "cpu")
    decides the attention path, the `auto` target dtype and autocast."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    dev = "cuda" if str(device).startswith("cuda") else "cpu"
    hf = hf_config if hf_config is not None else hf_config_for(cfg.target.name)
    s = _shapes(hf, cfg.target.layer_ids)
    parts_n = world_size * cfg.optim.grad_accum
    if cfg.optim.batch_size % parts_n:
        raise ValueError(
            f"optim.batch_size={cfg.optim.batch_size} must be divisible by "
            f"world_size*grad_accum={parts_n}"
        )
    b = cfg.optim.batch_size // parts_n
    plan = MemoryPlan(dev, world_size, b)
    tdtype = (
        cfg.target.dtype
        if cfg.target.dtype != "auto"
        else ("bfloat16" if dev == "cuda" else "float32")
    )
    tb = _BYTES[tdtype]
    amp = cfg.amp == "bf16" or (dev == "cuda" and cfg.amp == "auto")
    ab = 2 if amp else 4  # activation bytes (bf16 autocast)

    # --- persistent ------------------------------------------------------------------------
    embed = s.vocab * s.hidden
    target_params = embed * (1 if s.tied else 2) + s.layers * _layer_params(s, s.qk_norm)
    plan.parts["target_weights"] = target_params * tb + s.hidden * tb
    H, I, F = s.hidden, s.intermediate, len(s.layer_ids) * s.hidden
    layer_p = _layer_params(s, True)
    n_layers = cfg.drafter.num_layers
    drafter_p = F * H + H + n_layers * layer_p + H
    shard = world_size if cfg.distributed.strategy == "fsdp" and world_size > 1 else 1
    plan.parts["drafter_weights"] = 4 * drafter_p // shard
    plan.parts["drafter_grads"] = 4 * drafter_p // shard
    plan.parts["optimizer"] = 8 * drafter_p // shard
    extra = 0
    if shard > 1:  # one layer's full weights + gradients while it runs
        extra += 8 * layer_p
    elif world_size > 1:  # DDP's gradient buckets are a copy of the gradients
        extra += 4 * drafter_p
        plan.notes.append("DDP keeps one bucket copy of the gradients")
    if amp:  # autocast caches a bf16 copy of every weight for the step
        extra += 2 * drafter_p
    plan.parts["extra_copies"] = extra

    # --- target forward (no grad) ----------------------------------------------------------
    T = cfg.data.max_seq_len
    rows_t = b * T
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # Target.forward(with_logits=False) keeps only the feature layers' outputs and stops
    # after the highest one; with the last layer among them it keeps all N+1 states.
    # Sampled E2E/EDR need the target's logits: the full forward keeps all N+1 states.
    sampled = cfg.objective.build().needs_target_distribution and cfg.objective.mode != "greedy"
    last_used = max(s.layer_ids) >= s.layers - 1
    kept_states = s.layers + 1 if last_used or sampled else len(set(s.layer_ids))
    layer_transient = rows_t * (3 * I + 2 * q + 2 * kv + 2 * H)
    target_logits = rows_t * s.vocab * tb if sampled else 0
    plan.parts["target_forward"] = (
        tb * (kept_states * rows_t * H + rows_t * F + layer_transient) + target_logits
    )

    # --- drafter step ----------------------------------------------------------------------
    Kb = cfg.drafter.block_size
    A = drafted_blocks(cfg)  # EDR's no-grad scoring pass runs before, in chunks of that size
    N = b * A * Kb  # block query rows
    # What autograd keeps (read from layers.py; temporaries feeding an add are freed).
    # RMSNorm keeps its normalised copy and output (fp32 under autocast, plus the fp32
    # upcast of its input and the bf16 casts the next matmul makes); RoPE keeps the
    # rotated copy and its output.
    pre_norm = 16 if amp else 2 * ab  # norm feeding a linear
    qk_rope = 22 if amp else 4 * ab  # q/k norm + rope
    # Context: fc output and hidden_norm; per layer k (proj, norm, rope) and v (proj).
    ctx = rows_t * H * (ab + pre_norm) + rows_t * 2 * s.head_dim * ab
    ctx += n_layers * rows_t * kv * (ab + qk_rope + ab)
    # Block: embeddings, rope tables; per layer two pre-norms, q (proj, norm, rope), k
    # (same), v, the attention output's transposed copy, two residual sums, MLP (gate,
    # up, silu, product); final norm.
    per_layer = (
        2 * H * pre_norm + (q + kv) * (ab + qk_rope) + kv * ab + q * ab + 2 * H * ab + 4 * I * ab
    )
    block = N * (H * ab + 2 * s.head_dim * ab + n_layers * per_layer + H * pre_norm)
    plan.parts["drafter_activations"] = ctx + block
    plan.parts["drafter_attention"] = _attention_bytes(dev, b, T, A, Kb, s, n_layers, ab)
    rows_ce = b * A * (Kb - 1)
    cb = 4 if tb == 4 else tb
    if sampled:  # objectives/row_chunks.py: full drafter logits + target probabilities
        ce = _sampled_distribution_bytes(cfg, s.vocab, b, T, Kb, ab, world_size) + target_logits
        held = (
            "target logits and probabilities; the drafter's logits per row chunk only"
            if cfg.objective.kind.is_rounds_objective and world_size == 1
            else "target logits, [blocks, K, V] drafter logits, their gradient and target "
            "probabilities"
        )
        plan.notes.append(
            f"objective {cfg.objective.name}: counted for sampled rollouts ({held}); "
            "greedy rollouts need none of it (objective.mode=greedy)"
        )
    elif rows_ce * s.vocab * cb <= MAX_KEPT_PROBS_BYTES:
        ce = rows_ce * s.vocab * cb
    else:  # logits of one chunk + its softmax, recomputed in backward
        ce = 2 * default_chunk_rows(s.vocab) * s.vocab * 4
    plan.parts["cross_entropy"] = ce
    # Features stay alive through the step. The loop zeroes gradients with set_to_none,
    # so with one micro-batch they are created during backward while activations are
    # freed: the peak is at its start, with the last layer's weight gradients and the
    # gradient of one MLP intermediate on top of what is kept. With accumulation all
    # gradients live through the next micro-batch's forward.
    plan.grads_persist = cfg.optim.grad_accum > 1
    grad_transient = N * I * ab + (0 if plan.grads_persist else 4 * layer_p // shard)
    plan.parts["drafter_step"] = (
        rows_t * F * tb
        + plan.parts["drafter_activations"]
        + plan.parts["drafter_attention"]
        + ce
        + grad_transient
    )
    return plan


def _sampled_distribution_bytes(
    cfg: Any, vocab: int, b: int, T: int, Kb: int, ab: int, world_size: int = 1
) -> int:
    """Vocabulary-sized memory of a sampled E2E/EDR step: the drafter's `[rows, W]` logits
    and their gradient, the target's probabilities (fp32), and two ~64 MB float32
    per-chunk temporaries; W is V or a draft vocabulary + 2. One-process sampling EDR
    runs its LM head in checkpointed row chunks and holds only the target rows whole
    (`TargetRowTable`, when they fit the chunk budget)."""
    rounds = cfg.objective.kind.is_rounds_objective
    rows = b * drafted_blocks(cfg) * (Kb - 1)
    width = cfg.drafter.draft_vocab_size + 2 if cfg.drafter.draft_vocab_size else vocab
    chunk = min(rows, default_chunk_rows(vocab)) * vocab * 4
    if rounds and world_size == 1:
        table = min(b * T * width, DEFAULT_CHUNK_ELEMENTS)
        return max(rows * width, table) * 4 + 2 * chunk
    return rows * width * (2 * ab + 4) + 2 * chunk


def _attention_bytes(
    dev: str, b: int, T: int, A: int, Kb: int, s: _Shapes, n_layers: int, ab: int
) -> int:
    """Memory the block attention itself adds on the path `forward_blocks` takes."""
    N = b * A * Kb
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if dev == "cuda":
        # flex: concatenated [ctx; block] k and v per layer, out and logsumexp (fp32);
        # the BlockMask's int32 tile tables (two pairs, [b, N/128, (T+N)/128]).
        tiles = b * (-(-N // 128)) * (-(-(T + N) // 128))
        per_layer = 2 * b * (T + A * Kb) * kv * ab + N * q * ab + N * s.heads * 4
        return n_layers * per_layer + 4 * 4 * tiles
    # tiled: per tile of `TILE_QUERIES // Kb` blocks, concatenated k/v over the tile's
    # context (at most T; sorted anchors spread it evenly: T/2 on average) and slots,
    # SDPA's output and logsumexp; additive masks built once for all layers.
    per_tile = max(1, TILE_QUERIES // Kb)
    n_tiles = -(-A // per_tile)
    tq = per_tile * Kb
    keys = n_tiles * (T // 2 + tq)
    per_layer = 2 * b * keys * kv * ab + N * q * ab + N * s.heads * 4
    masks = b * n_tiles * tq * (T // 2 + tq) * ab
    return n_layers * per_layer + masks
