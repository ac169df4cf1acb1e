"""Data for drafter training: prompt sources, target rollouts on disk, anchors and blocks."""

from blockdraft.data.anchors import (
    BlockBatch,
    block_labels,
    collate_blocks,
    round_start_anchors,
    sample_anchors,
)
from blockdraft.data.prompt_specs import load_prompts, render_prompt
from blockdraft.data.prompt_type import Prompt, PromptError
from blockdraft.data.rollouts import (
    Rollout,
    RolloutError,
    RolloutSet,
    SamplingSettings,
    generate_rollouts,
    sampling_logprobs,
    split_by_prompt,
)

__all__ = [
    "BlockBatch",
    "Prompt",
    "PromptError",
    "Rollout",
    "RolloutError",
    "RolloutSet",
    "SamplingSettings",
    "block_labels",
    "collate_blocks",
    "generate_rollouts",
    "load_prompts",
    "render_prompt",
    "round_start_anchors",
    "sample_anchors",
    "sampling_logprobs",
    "split_by_prompt",
]
