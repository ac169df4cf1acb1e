"""Shared helpers of the training-step benches (`train_step.py`, `train_memory.py`,
`train_objectives.py`): the benchmark shapes, a random target and batch of a shape, and one
drafter step on a given attention / cross-entropy path. One module that the three import,
so none of them imports another.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

import blockdraft.objectives.cross_entropy as ce
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.cross_entropy import weighted_cross_entropy
from blockdraft.targets.target import Target
from blockdraft.training.draft_forward import DraftForward
from fixture_targets import make_random_target


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # HF architecture of the random target
    batch: int
    prompt: int
    response: int
    anchors: int
    block: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers: int
    drafter_layers: int
    draft_vocab: int | None = None


SHAPES = {
    # the demo's step: 8 sequences x 64 anchors x block 8, tiny target (4 layers, width 128)
    "tiny": Shape("tiny", "qwen3", 8, 48, 128, 64, 8, 128, 4, 2, 32, 384, 4096, 4, 1),
    # Gemma 3 270M geometry and configs/gemma-3-270m.yaml's drafter (2 layers, block 16,
    # 32k draft vocabulary); batch and length cut so a step takes seconds on CPU
    "gemma": Shape(
        "gemma", "gemma3", 2, 128, 256, 64, 16, 640, 4, 1, 256, 2048, 262144, 6, 2, 32768
    ),
    # configs/gemma-3-270m.yaml's batch and drafter as DFlash (2 layers, block 8, 8k vocabulary)
    "servable": Shape(
        "servable", "gemma3", 8, 64, 128, 32, 8, 640, 4, 1, 256, 2048, 262144, 6, 2, 8192
    ),
    # DFlash's recipe (T=3072, 512 anchors, block 16, Qwen3 vocabulary) scaled down 4x in
    # length and anchors, 8x in width, 1 drafter layer, and a 16k draft vocabulary: with
    # the full 152k vocabulary both paths run the same chunked CE (1,920 x 151,936 rows do
    # not fit the budget) and one step takes minutes on a shared CPU
    "recipe": Shape(
        "recipe", "qwen3", 1, 128, 640, 128, 16, 512, 8, 2, 64, 1536, 151936, 4, 1, 16384
    ),
}


# The scaled recipe with 256 anchors (half the recipe's 512): the attention-specific memory
# then dominates the peak, as it does at the full recipe.
MEMORY_SHAPE = dataclasses.replace(SHAPES["recipe"], anchors=256)


def random_target(s: Shape) -> Target:
    """A random target of the shape's geometry (weights never run: features are given)."""
    small = make_random_target("qwen3")  # borrows its tokenizer and mask token
    geometry = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.target_layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=4096,
    )
    if s.arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**geometry, query_pre_attn_scalar=s.head_dim))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**geometry, tie_word_embeddings=True))
    return Target(
        model, small.tokenizer, name=f"random-{s.name}", mask_token_id=small.mask_token_id
    )


def build(s: Shape, seed: int = 0):  # type: ignore[no-untyped-def]
    """(drafter, features, input_ids, anchors [sorted, as sampled], labels, prev)."""
    torch.manual_seed(seed)
    target = random_target(s)
    cfg = DrafterConfig.for_target(
        target, num_layers=s.drafter_layers, block_size=s.block, draft_vocab_size=s.draft_vocab
    )
    drafter = BlockDrafter(cfg).bind_target(target)
    if s.draft_vocab:
        drafter.set_draft_vocab(torch.arange(s.draft_vocab))
    g = torch.Generator().manual_seed(seed)
    T, K = s.prompt + s.response, s.block - 1
    ids = torch.randint(3, s.draft_vocab or s.vocab, (s.batch, T), generator=g)
    feats = torch.randn(s.batch, T, target.feature_size, generator=g)
    anchors = torch.stack(
        [
            s.prompt + torch.randperm(s.response - 1, generator=g)[: s.anchors].sort().values
            for _ in range(s.batch)
        ]
    )
    pos = anchors[..., None] + torch.arange(1, K + 1)
    labels = torch.where(
        pos < T, ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view(pos.shape), -1
    )
    prev = torch.cat([ids.gather(1, anchors)[..., None], labels[..., :-1].clamp(min=0)], -1)
    return drafter, feats, ids, anchors, labels, prev


PATHS = {  # name -> (attention, MAX_KEPT_PROBS_BYTES)
    "old": ("dense", 0),
    "new": ("auto", ce.MAX_KEPT_PROBS_BYTES),
    "attn-only": ("auto", 0),
    "ce-only": ("dense", ce.MAX_KEPT_PROBS_BYTES),
}


def drafter_step(fwd: DraftForward, batch, path: str, bf16: bool = False) -> float:  # type: ignore[no-untyped-def]
    """One drafter forward + uniform-weighted CE + backward on `path` (under CPU bf16
    autocast when `bf16`, as `amp: bf16` trains); seconds."""
    _, feats, ids, anchors, labels, prev = batch
    fwd.drafter.attention, ce.MAX_KEPT_PROBS_BYTES = PATHS[path]
    fwd.drafter.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, logq, _ = fwd(feats, ids, anchors, labels, prev)
        loss = weighted_cross_entropy(logq, torch.ones(()), labels >= 0)
    loss.backward()
    return time.perf_counter() - t0
