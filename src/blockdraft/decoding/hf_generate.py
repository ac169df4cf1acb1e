"""Hugging Face `generate` as the baseline users already have, timed next to our loops.

Why here and not only in `bench/decode.py`: every speedup a user reads (the demo's
report included) should be against what they would otherwise run, not only against our
own autoregressive loop. `hf_generate_job` builds one `model.generate` call (greedy, or
plain sampling at T with top-k/top-p off, optionally HF's prompt-lookup assisted
generation); `ar_vs_hf` times it alternately with `ar_generate` on the same prompts, so
the ratio is measured side by side and any speedup over the AR loop converts to one over
HF generate by multiplication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from blockdraft.decoding.loop import ar_generate
from blockdraft.decoding.timing import alternate_timed
from blockdraft.threads import OtherLoad


def hf_generate_job(
    target: Any,
    prompt: Sequence[int],
    temperature: float,
    max_new_tokens: int,
    lookup: int = 0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Callable[[], list[int]]:
    """A zero-argument call of `target.model.generate` on `prompt` -> new token ids.

    `lookup=K` turns on prompt-lookup assisted generation with K candidates (matching
    n-grams of up to 2 tokens, the setting of blockdraft's `ngram` drafter); at T > 0 it
    samples with HF's own top-p / top-k (off by default)."""
    ids = torch.tensor([list(prompt)], device=getattr(target, "device", "cpu"))
    kw: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=list(target.stop_token_ids) or None,
        pad_token_id=target.tokenizer.pad_token_id or 0,
    )
    if temperature == 0:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    if lookup:
        kw.update(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=2)

    def run() -> list[int]:
        with torch.inference_mode():
            return target.model.generate(ids, **kw)[0, len(prompt) :].tolist()

    return run


def has_hf_generate(target: Any) -> bool:
    """Whether the target is backed by a Hugging Face model with `generate`."""
    model = getattr(target, "model", None)
    return callable(getattr(model, "generate", None)) and hasattr(target, "tokenizer")


def ar_vs_hf(
    target: Any,
    prompts: Sequence[Sequence[int]],
    temperature: float,
    max_new_tokens: int,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict[str, float]:
    """HF generate and our AR loop on the same prompts, alternately (HF, AR per prompt,
    after one warm-up each) -> tokens/s of both and `ar_vs_hf` (AR tok/s / HF tok/s)."""

    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)

    def jobs(prompt: Sequence[int], n: int) -> dict[str, Callable[[], list[int]]]:
        return {
            "hf": hf_generate_job(target, prompt, max_new_tokens=n, **sampling),
            "ar": lambda: ar_generate(target, list(prompt), max_new_tokens=n, **sampling),
        }

    alternate_timed(jobs(prompts[0], min(4, max_new_tokens)))  # warm-up
    seconds = {"hf": 0.0, "ar": 0.0}
    tokens = {"hf": 0, "ar": 0}
    with OtherLoad() as load:
        for prompt in prompts:
            results, took = alternate_timed(jobs(prompt, max_new_tokens))
            for name in seconds:
                seconds[name] += took[name]
                tokens[name] += len(results[name])
    hf, ar = (tokens[n] / max(seconds[n], 1e-12) for n in ("hf", "ar"))
    return {
        "hf_tokens_per_s": hf,
        "ar_tokens_per_s": ar,
        "ar_vs_hf": ar / max(hf, 1e-12),
        # other processes held the cores these timings needed (threads.OtherLoad)
        "ar_vs_hf_busy": load.contended(torch.get_num_threads()),
        "ar_vs_hf_other_load_cores": load.others,
    }


def versus_hf(
    target: Any, prompts: Sequence[Sequence[int]], speedup: float, **settings: Any
) -> dict[str, float]:
    """`ar_vs_hf` plus `speedup_vs_hf`: a speculative run's speedup over our AR loop (timed
    alternately with it) times the AR loop's ratio to HF generate (timed likewise)."""
    timing = ar_vs_hf(target, prompts, **settings)
    return {**timing, "speedup_vs_hf": speedup * timing["ar_vs_hf"]}
