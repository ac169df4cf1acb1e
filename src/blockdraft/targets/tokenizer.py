"""Byte-level BPE tokenizers for the embedded targets, trained with HF `tokenizers`.

The embedded targets need their own vocabulary (no hub download) with two reserved
tokens: an end-of-text token (the stop token) and a mask token that the drafter fills
its blocks with and the target never produces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]
UNNAMED_SPECIAL_TOKEN = "<gh_stars>"  # a special token that is not a mask token


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, *, mask_token: str | None = MASK_TOKEN
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; special tokens get ids 0 (eos), 1 (pad), 2 (mask).

    `mask_token=None` names no mask token: id 2 is then `UNNAMED_SPECIAL_TOKEN`, a special
    token that no reserved-token pattern matches (like most instruct models' tokenizers).
    """
    # lazy: transformers takes seconds to import; `targets.registry` imports this module
    # (through `tiny`) for every stage, most of which never train a tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS
        if mask_token
        else [EOS_TOKEN, PAD_TOKEN, UNNAMED_SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        **({"mask_token": mask_token} if mask_token else {}),
    )
