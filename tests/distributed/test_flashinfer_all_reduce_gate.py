"""The capability checks of FlashInfer's fused all-reduce (CUDA): world sizes 2/4/8, compute
capability 9.0 or 10.x, FlashInfer installed, the size limit; the multi-GPU kernel itself
needs two Hopper/Blackwell GPUs and FlashInfer (skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch

from vllm.distributed import flashinfer_all_reduce as fi


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3)])
def test_supported_where_upstream_enables_it(world, capability):
    ok, why = fi.fusion_supported(world, capability, flashinfer_present=True)
    assert ok, why


@pytest.mark.parametrize("world, capability, present, reason", [
    (1, (9, 0), True, "one rank"),
    (3, (9, 0), True, "world size 3"),
    (16, (10, 0), True, "world size 16"),
    (2, (8, 0), True, "compute capability (8, 0)"),
    (2, (12, 0), True, "compute capability (12, 0)"),
    (2, (9, 0), False, "not installed"),
    (2, None, True, "compute capability None"),
])
def test_refused_elsewhere(world, capability, present, reason):
    ok, why = fi.fusion_supported(world, capability, flashinfer_present=present)
    assert not ok and reason in why


def test_size_limit_in_tokens():
    # Hopper, 8 ranks: 0.5 MiB of bf16 rows of 4096 -> 64 tokens; 2 ranks: 64 MiB -> 8192.
    assert fi.max_tokens(8, (9, 0), 4096, 2) == 64
    assert fi.max_tokens(2, (9, 0), 4096, 2) == 8192
    assert fi.max_tokens(3, (9, 0), 4096, 2) == 0
    assert fi.max_tokens(2, (8, 6), 4096, 2) == 0


def _gpus_for_flashinfer() -> bool:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    cap = torch.cuda.get_device_capability()
    return fi.fusion_supported(2, cap, None)[1] != "FlashInfer is not installed" and (
        cap == (9, 0) or cap[0] == 10)


@pytest.mark.skipif(not _gpus_for_flashinfer(),
                    reason="needs 2 Hopper/Blackwell GPUs and FlashInfer")
def test_flashinfer_comm_has_the_fusion_api():
    assert fi.flashinfer_comm() is not None
