"""Upstream's `vllm.v1` module paths for names this package keeps elsewhere (its layout has
no v0/v1 split)."""
