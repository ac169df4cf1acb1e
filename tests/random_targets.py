"""Small random targets for tests and examples: built from a config in well under a second.

They have the real architecture (Qwen3 by default, Llama and Gemma 3 on request) and a
real BPE tokenizer, but random weights, so tests exercise exactly the code paths of a
real target without downloads or training.
"""

from __future__ import annotations

from pathlib import Path

import torch

from blockdraft.targets.target import Target
from blockdraft.targets.tokenizer import MASK_TOKEN, UNNAMED_SPECIAL_TOKEN, train_bpe_tokenizer

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. 0123456789\n",
] * 4


_CLASSES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
}


def _classes(arch: str) -> tuple[type, type]:
    """transformers' (model class, config class) of a test architecture."""
    if arch not in _CLASSES:
        raise ValueError(f"unknown test architecture {arch!r}: use qwen3, llama or gemma3")
    # lazy: transformers takes seconds to import
    import transformers

    return tuple(getattr(transformers, name) for name in _CLASSES[arch])  # type: ignore[return-value]


def make_random_target(
    arch: str = "qwen3",
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    named_mask: bool = True,
) -> Target:
    """A randomly initialised target of the given architecture with a trained BPE tokenizer.

    `named_mask=False`: the tokenizer names no mask token and has no reserved one (id 2 is
    `<gh_stars>`, which the returned `Target` uses), as most instruct models."""
    tokenizer = train_bpe_tokenizer(
        _CORPUS, vocab_size=vocab_size, mask_token=MASK_TOKEN if named_mask else None
    )
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    extra = {
        "qwen3": dict(tie_word_embeddings=True),
        "llama": dict(tie_word_embeddings=False),
        "gemma3": dict(sliding_window=64, query_pre_attn_scalar=hidden_size // num_heads),
    }
    model_cls, config_cls = _classes(arch)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra[arch])).to(dtype).eval()
    return Target(
        model,
        tokenizer,
        name=f"random-{arch}",
        mask_token_id=tokenizer.convert_tokens_to_ids(
            MASK_TOKEN if named_mask else UNNAMED_SPECIAL_TOKEN
        ),
    )


def save_target_without_mask(directory: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """A small random target saved as a local HF model whose tokenizer names no mask token
    and has no reserved token: loading it needs a mask token from the user or a record."""
    target = make_random_target(arch, num_layers=4, seed=seed, named_mask=False)
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return Path(directory)


# Published shapes of the targets the benches time (targets/tiny.py TinyConfig; Gemma 3
# 270M's and Qwen3-8B's configs), so every bench measures the same model without a download.
SHAPES: dict[str, tuple[str, dict]] = {
    "tiny": (
        "qwen3",
        dict(
            vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=2048, tie_word_embeddings=True,
        ),
    ),
    "gemma-3-270m": (
        "gemma3",
        dict(
            vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            query_pre_attn_scalar=256, max_position_embeddings=32768, rope_theta=1e6,
        ),
    ),
    "qwen3-8b": (  # tests/training/fixtures/qwen3_8b_config.json
        "qwen3",
        dict(
            vocab_size=151_936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    ),
}  # fmt: skip


def make_shaped_target(
    shape: str,
    seed: int = 0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides: int,
) -> Target:
    """Random weights at a real target's shape (`SHAPES`), with the small test tokenizer:
    for timing only (the model's compute is the real one's). `overrides` replace config
    fields (`num_hidden_layers=8`: an 8B width in a time budget); `device`/`dtype` build
    the weights there directly (an 8B shape initialises on a GPU in seconds)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {sorted(SHAPES)}")
    arch, fields = SHAPES[shape]
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for shape {shape!r}")
    fields = {**fields, **overrides}
    tok = make_random_target(arch).tokenizer
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    cls, config_cls = _classes(arch)
    with torch.device(device or "cpu"):
        model = cls._from_config(config_cls(**fields, **ids), dtype=dtype or torch.float32)
    mask = tok.convert_tokens_to_ids(MASK_TOKEN)
    return Target(model.eval(), tok, name=f"{shape}-shaped", mask_token_id=mask)


def confident_random_drafter(draft_vocab: bool = False, lookup_inputs: bool = False):
    """(target, drafter): a random qwen3 target with a sharpened head and a random 1-layer
    block-5 drafter whose inputs are scaled up, so its slot confidences spread over (0, 1)
    (per-slot confidence rules then choose both ways); `draft_vocab`: on a reduced
    vocabulary of every other target id (the target's tokens then fall outside it)."""
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    torch.manual_seed(0)
    target = make_random_target("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    size = target.vocab_size // 2 if draft_vocab else None
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=5, draft_vocab_size=size, lookup_inputs=lookup_inputs
    )
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(0, target.vocab_size, 2)[:size])
    with torch.no_grad():
        drafter.fc.weight.mul_(20.0)
    return target, drafter
