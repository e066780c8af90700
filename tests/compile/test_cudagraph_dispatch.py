"""CudagraphDispatcher: padding table, key sets per mode, dispatch priority. Pure Python."""
from __future__ import annotations

import pytest

from vllm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def make_dispatcher(mode: CUDAGraphMode, sizes=(1, 2, 4, 8, 16), max_num_seqs=8,
                    query_len=1) -> CudagraphDispatcher:
    config = VllmConfig()
    # The CPU platform resolves no CUDA graphs; set what a CUDA config would have resolved.
    config.compilation_config.cudagraph_capture_sizes = list(sizes)
    config.compilation_config.max_cudagraph_capture_size = max(sizes)
    config.scheduler_config.max_num_seqs = max_num_seqs
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, uniform_decode_query_len=query_len)
    return dispatcher


def test_padding_table_rounds_up_to_the_next_capture_size():
    d = make_dispatcher(PIECEWISE)
    assert [d.pad(n) for n in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8
    assert d.pad(17) == 17  # above the largest size: unpadded
    assert len(d.padded) == 17  # built once, 0..max


@pytest.mark.parametrize("num_tokens,expected", [(1, 1), (3, 4), (5, 8), (16, 16)])
def test_piecewise_mode_pads_and_relaxes_keys(num_tokens, expected):
    d = make_dispatcher(PIECEWISE)
    mode, desc = d.dispatch(num_tokens, num_reqs=2, uniform_decode=False)
    assert mode == PIECEWISE
    assert desc == BatchDescriptor(expected)  # num_reqs None, uniform False


def test_above_max_capture_size_runs_without_graphs_unpadded():
    d = make_dispatcher(FULL)
    mode, desc = d.dispatch(17, num_reqs=3, uniform_decode=False)
    assert mode == NONE
    assert desc.num_tokens == 17


def test_full_and_piecewise_prefers_full_for_uniform_decode():
    d = make_dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE)
    mode, desc = d.dispatch(3, num_reqs=3, uniform_decode=True)
    assert (mode, desc) == (FULL, BatchDescriptor(4, 4, True))
    mode, desc = d.dispatch(3, num_reqs=2, uniform_decode=False)
    assert (mode, desc) == (PIECEWISE, BatchDescriptor(4))
    # Uniform-decode FULL keys exist only up to query_len * max_num_seqs tokens.
    mode, desc = d.dispatch(12, num_reqs=12, uniform_decode=True)
    assert (mode, desc) == (PIECEWISE, BatchDescriptor(16))


def test_full_decode_only_leaves_mixed_batches_eager():
    d = make_dispatcher(CUDAGraphMode.FULL_DECODE_ONLY)
    assert d.dispatch(2, 2, True) == (FULL, BatchDescriptor(2, 2, True))
    mode, desc = d.dispatch(5, 2, False)
    assert mode == NONE and desc.num_tokens == 5


def test_full_mode_uses_mixed_keys_for_every_batch():
    d = make_dispatcher(FULL)
    assert d.dispatch(3, 3, True) == (FULL, BatchDescriptor(4, 4, False))
    assert d.dispatch(7, 2, False) == (FULL, BatchDescriptor(8, 8, False))
    assert d.dispatch(16, 5, False) == (FULL, BatchDescriptor(16, 8, False))  # min(max_num_seqs)


def test_none_mode_and_uninitialized_dispatch_none():
    d = make_dispatcher(NONE)
    assert d.dispatch(4, 4, True)[0] == NONE
    config = VllmConfig()
    raw = CudagraphDispatcher(config)
    assert raw.dispatch(1, 1, True)[0] == NONE


def test_spec_decode_query_len_sets_uniform_key_range():
    d = make_dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, sizes=(2, 4, 8, 16, 32), query_len=2)
    mode, desc = d.dispatch(4, 2, True)
    assert (mode, desc) == (FULL, BatchDescriptor(4, 2, True))
    assert BatchDescriptor(32, 16, True) not in d.keys[FULL]  # 32 > 2 * max_num_seqs(8)


def test_capture_order_piecewise_first_then_full_largest_first():
    d = make_dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, sizes=(1, 2, 4))
    order = d.capture_descriptors()
    assert [m for m, _ in order] == [PIECEWISE] * 3 + [FULL] * 3
    assert [k.num_tokens for _, k in order] == [4, 2, 1, 4, 2, 1]
