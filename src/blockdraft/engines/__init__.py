"""Serving engines run by blockdraft: vLLM, imported only when a command asks for it."""
