"""A pass's uuid is part of the compile-cache key, so it must be the same in every process
that runs the same code: another process (a restart, the other tensor-parallel rank) must find
the entry the first one stored. A uuid built from a repr with a memory address in it (e.g. of
a `functools.cache`-wrapped function) would differ per process and make every start a miss."""
from __future__ import annotations

import functools
from pathlib import Path

from tests.fresh_python import run_fresh
from vllm.compilation.passes.inductor_pass import source_hash

PRINT_UUIDS = """
import torch
from vllm.compilation.passes.fusion.act_quant_fusion import ActivationQuantFusionPass
from vllm.compilation.passes.fusion.rms_quant_fusion import RMSNormQuantFusionPass
print(RMSNormQuantFusionPass(None, dtypes=[torch.float32], decompose=[True]).uuid())
print(ActivationQuantFusionPass(None, dtypes=[torch.float32], decompose=[True]).uuid())
"""


@functools.cache
def _cached() -> int:
    return 1


def test_source_hash_sees_through_functools_cache():
    # The wrapper has no source file of its own: hashing it must read this file, not a repr.
    assert source_hash(_cached) == source_hash(__file__)


def test_fusion_pass_uuids_are_the_same_in_two_processes():
    root = Path(__file__).resolve().parents[3]
    first, second = (run_fresh(PRINT_UUIDS, root).split() for _ in range(2))
    assert len(first) == 2 and first == second


def test_a_fusion_pass_uuid_neither_traces_nor_imports_the_pattern_matcher():
    """A warm start builds the passes for the cache key only: no tracing, no Inductor."""
    code = PRINT_UUIDS + (
        "import sys\n"
        "print('matcher-imported' if 'torch._inductor.pattern_matcher' in sys.modules "
        "else 'matcher-not-imported')\n")
    out = run_fresh(code, Path(__file__).resolve().parents[3]).split()
    assert out[-1] == "matcher-not-imported", out
