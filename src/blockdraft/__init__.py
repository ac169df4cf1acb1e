"""blockdraft: train and evaluate parallel block draft models for speculative decoding."""

__version__ = "0.1.0"
