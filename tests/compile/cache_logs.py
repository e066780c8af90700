"""Reading the compile-cache lines of a child engine's log (the e2e cache tests)."""
from __future__ import annotations

import pytest


def cache_dir_in(log: str) -> str:
    """The entry directory from the "compile cache: using <dir>" line."""
    return log.split("compile cache: using ", 1)[1].split()[0]


def same_key_or_skip(first: str, later: str) -> None:
    """The key covers our source: an edit of vllm/ between the processes (someone working in
    the same checkout) rightly moves the cache to a new directory."""
    if cache_dir_in(first) != cache_dir_in(later):
        pytest.skip("the package source changed while the test ran (new cache key)")
