"""Triton kernels for the FP8 ops on CUDA (placeholder until written; see available())."""
from __future__ import annotations


def available() -> bool:
    return False
