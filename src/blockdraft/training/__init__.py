"""Training drafters: one typed config, every objective, resumable, data-parallel.

Public API: `train(config, target=None, resume=False, overwrite=False) -> Path`, `load_config(path,
overrides)`, `TrainConfig`, `ConfigError`. See docs/training.md.
"""

from blockdraft.training.config import ConfigError, TrainConfig, config_from_dict, load_config


def train(config, *, target=None, resume=False, overwrite=False):  # noqa: ANN001 - lazy re-export
    """See `blockdraft.training.trainer.train` (imported lazily: it pulls in torch models)."""
    from blockdraft.training.trainer import train as _train

    return _train(config, target=target, resume=resume, overwrite=overwrite)


__all__ = ["ConfigError", "TrainConfig", "config_from_dict", "load_config", "train"]
