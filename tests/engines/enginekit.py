"""Shared marks for the engine tests."""

import pytest

from blockdraft.engines.dflash_support import vllm_version

needs_vllm = pytest.mark.skipif(
    vllm_version() is None, reason="vLLM is not installed (`make engine` installs it)"
)
