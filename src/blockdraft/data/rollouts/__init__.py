"""Target rollouts: generated (`generate.py`, by blockdraft's own sampler in `sampler.py`,
by a serving engine in `engine.py`, over N processes in `distributed.py`) or imported from
an engine's records (`importer.py`, `import_records.py`, `teacher_forcing.py`), stored as
safetensors shards (`shards.py`) listed by a manifest (`store.py`).

One package because every way in ends in the same rollout directory, read the same way.
"""

from blockdraft.data.rollouts.generate import generate_rollouts
from blockdraft.data.rollouts.shards import Rollout
from blockdraft.data.rollouts.store import RolloutError, RolloutSet, split_by_prompt
from blockdraft.sampling import SamplingSettings, sampling_logprobs

__all__ = [
    "Rollout",
    "RolloutError",
    "RolloutSet",
    "SamplingSettings",
    "generate_rollouts",
    "sampling_logprobs",
    "split_by_prompt",
]
