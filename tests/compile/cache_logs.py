"""Child engine processes of the e2e cache tests: their environment and their logs."""
from __future__ import annotations

import os

import pytest


def child_env(tmp_path, extra: dict | None = None) -> dict:
    """A child's environment: a cache root of the test's own, the cache on, recompiles are
    errors."""
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "root"),
               VLLM_TEST_FAIL_ON_RECOMPILE="1")
    env.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    env.update(extra or {})
    return env


def cache_dir_in(log: str) -> str:
    """The entry directory from rank 0's "compile cache: using <dir>" line (the other
    tensor-parallel ranks' lines, "(TP rank=1 ...) ...", come in any order with it)."""
    lines = [line for line in log.splitlines() if "compile cache: using " in line]
    line = next((x for x in lines if "(TP rank=" not in x), lines[0])
    return line.split("compile cache: using ", 1)[1].split()[0]


def same_key_or_skip(first: str, later: str) -> None:
    """The key covers our source: an edit of vllm/ between the processes (someone working in
    the same checkout) rightly moves the cache to a new directory."""
    if cache_dir_in(first) != cache_dir_in(later):
        pytest.skip("the package source changed while the test ran (new cache key)")
