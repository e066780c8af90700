"""Attention backends (imported lazily through vllm.attention.selector)."""
