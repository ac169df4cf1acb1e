"""Training drafters: one typed config, every objective, resumable, data-parallel.

Public API: `train(config, *, target=None, resume=False, overwrite=False, allow_changed=())
-> Path`, `load_config(path, overrides)`, `TrainConfig`, `ConfigError`. See docs/training.md.
"""

from blockdraft.training.config import ConfigError, TrainConfig, config_from_dict, load_config
from blockdraft.training.trainer import train

__all__ = ["ConfigError", "TrainConfig", "config_from_dict", "load_config", "train"]
