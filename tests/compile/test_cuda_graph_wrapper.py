"""CUDAGraphWrapper with an injected fake graph: capture once per key, replay after."""
from __future__ import annotations

import pytest
import torch

from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper, FakeCUDAGraph, override_graph_factory
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context

PIECEWISE, FULL, NONE = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.NONE


class Doubler:
    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2

    def extra(self):
        return "delegated"


@pytest.fixture
def config():
    return VllmConfig()


def run(wrapper, config, x, mode, desc):
    with set_forward_context(None, config, cudagraph_runtime_mode=mode, batch_descriptor=desc):
        return wrapper(x)


def test_capture_then_replay_per_descriptor(config):
    graphs = []

    def factory():
        graphs.append(FakeCUDAGraph())
        return graphs[-1]

    runnable = Doubler()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE, graph_factory=factory)
    buffer = torch.zeros(16)  # the runner's persistent input buffer
    with compilation_counter.expect(num_cudagraph_captured=2, num_cudagraph_replayed=3):
        buffer[:4] = 1
        out = run(wrapper, config, buffer[:4], PIECEWISE, BatchDescriptor(4))
        assert torch.equal(out, torch.full((4,), 2.0))
        buffer[:4] = 3
        out2 = run(wrapper, config, buffer[:4], PIECEWISE, BatchDescriptor(4))
        # a replay returns the captured output buffer, refreshed
        assert out2.data_ptr() == out.data_ptr() and out2.shape == out.shape
        assert torch.equal(out2, torch.full((4,), 6.0))
        run(wrapper, config, buffer[:8], PIECEWISE, BatchDescriptor(8))
        run(wrapper, config, buffer[:8], PIECEWISE, BatchDescriptor(8))
        run(wrapper, config, buffer[:4], PIECEWISE, BatchDescriptor(4))
    assert [(g.num_captures, g.num_replays) for g in graphs] == [(1, 2), (1, 1)]
    assert set(wrapper.entries) == {BatchDescriptor(4), BatchDescriptor(8)}


class HoldsNothing:
    """Like a real CUDA graph: keeps no Python reference to what the captured call returned."""

    def capture(self, fn):
        return fn()

    def replay(self):
        pass


def test_entries_do_not_keep_captured_outputs_alive(config):
    """Every (piece, size) keeps its outputs' addresses, not the tensors: once the forward
    that captured them is done, their memory goes back to the graphs' pool for the next
    captures (held, it added up to gigabytes over the capture sizes)."""
    import gc
    import weakref

    wrapper = CUDAGraphWrapper(lambda x: (x * 2, [x + 1]), config, PIECEWISE,
                               graph_factory=HoldsNothing)
    out, (extra,) = run(wrapper, config, torch.ones(4), PIECEWISE, BatchDescriptor(4))
    alias, (extra_alias,) = wrapper.entries[BatchDescriptor(4)].output
    assert (alias.data_ptr(), alias.shape, alias.dtype) == (out.data_ptr(), out.shape, out.dtype)
    assert extra_alias.data_ptr() == extra.data_ptr()
    assert torch.equal(alias, out)  # the same memory, seen through the alias
    out_ref, extra_ref = weakref.ref(out), weakref.ref(extra)
    del out, extra
    gc.collect()
    assert out_ref() is None and extra_ref() is None


def test_other_or_none_mode_calls_the_runnable(config):
    runnable = Doubler()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE, graph_factory=FakeCUDAGraph)
    x = torch.ones(3)
    with compilation_counter.expect(num_cudagraph_captured=0, num_cudagraph_replayed=0):
        run(wrapper, config, x, NONE, BatchDescriptor(3))
        run(wrapper, config, x, FULL, BatchDescriptor(3))  # a FULL graph wraps elsewhere
        assert torch.equal(wrapper(x), x * 2)  # no forward context at all
    assert runnable.calls == 3
    assert wrapper.entries == {}


def test_full_wrapper_ignores_piecewise_mode(config):
    runnable = Doubler()
    wrapper = CUDAGraphWrapper(runnable, config, FULL, graph_factory=FakeCUDAGraph)
    x = torch.ones(2)
    run(wrapper, config, x, PIECEWISE, BatchDescriptor(2))
    assert wrapper.entries == {}
    run(wrapper, config, x, FULL, BatchDescriptor(2, 2, True))
    assert list(wrapper.entries) == [BatchDescriptor(2, 2, True)]


def test_override_factory_and_delegation(config):
    with override_graph_factory(FakeCUDAGraph):
        wrapper = CUDAGraphWrapper(Doubler(), config, PIECEWISE)
    assert wrapper.graph_factory is FakeCUDAGraph
    assert wrapper.extra() == "delegated"


def test_address_check_catches_inputs_that_moved(config):
    wrapper = CUDAGraphWrapper(Doubler(), config, PIECEWISE, graph_factory=FakeCUDAGraph,
                               check_input_addresses=True)
    run(wrapper, config, torch.ones(4), PIECEWISE, BatchDescriptor(4))
    with pytest.raises(RuntimeError, match="other addresses"):
        run(wrapper, config, torch.ones(4), PIECEWISE, BatchDescriptor(4))


def test_rejects_non_runtime_modes(config):
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        CUDAGraphWrapper(Doubler(), config, CUDAGraphMode.FULL_AND_PIECEWISE)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_graph_capture_and_replay(config):
    runnable = Doubler()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    buffer = torch.zeros(8, device="cuda")
    buffer[:4] = 1
    run(wrapper, config, buffer[:4], NONE, None)  # warm-up outside capture
    out = run(wrapper, config, buffer[:4], PIECEWISE, BatchDescriptor(4))
    assert torch.equal(out.cpu(), torch.full((4,), 2.0))
    buffer[:4] = 5
    out = run(wrapper, config, buffer[:4], PIECEWISE, BatchDescriptor(4))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.full((4,), 10.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_graph_outputs_are_reused_by_later_captures(config):
    """Graphs of sizes 8..1, output n x 4 MiB: all held, 144 MiB would stay allocated; freed
    after each capture, later ones reuse the memory and the pool stays near the largest
    (32 MiB, plus the intermediate)."""
    runnable = lambda x: x.unsqueeze(-1).expand(-1, 1 << 20).contiguous() * 2  # noqa: E731
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    buffer = torch.ones(8, device="cuda")
    run(wrapper, config, buffer[:8], NONE, None)  # warm-up outside capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for n in range(8, 0, -1):
        out = run(wrapper, config, buffer[:n], PIECEWISE, BatchDescriptor(n))
        del out
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    assert grown < 96 << 20, grown
    buffer[:3] = 5
    out = run(wrapper, config, buffer[:3], PIECEWISE, BatchDescriptor(3))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.full((3, 1 << 20), 10.0))

