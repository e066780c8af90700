"""Splitting, per-size and per-range compiles, and piecewise CUDA graphs (fake graphs)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.compilation.backends import split_graph
from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper, FakeCUDAGraph, override_graph_factory
from vllm.compilation.decorators import support_torch_compile
from vllm.compilation.piecewise_backend import PiecewiseBackend
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.config.utils import Range, compile_ranges
from vllm.forward_context import BatchDescriptor, set_forward_context

SILLY_OP = "silly_piecewise::attention"


@torch.library.custom_op(SILLY_OP, mutates_args=["out"])
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q + k * v)


@support_torch_compile
class Toy(nn.Module):
    def __init__(self, num_attn: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(num_attn + 1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x) + positions[:, None]
        for layer in self.layers[1:]:
            out = torch.empty_like(x)
            torch.ops.silly_piecewise.attention(x, x, x, out)
            x = layer(out)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(num_attn: int = 2, **compilation) -> Toy:
    compilation.setdefault("backend", "eager")
    compilation.setdefault("splitting_ops", [SILLY_OP])
    config = VllmConfig(optimization_level=1, compilation_config=CompilationConfig(**compilation))
    torch.manual_seed(0)
    with set_current_vllm_config(config):
        return Toy(num_attn)


def inputs(n: int):
    return torch.randn(n, 4), torch.arange(n, dtype=torch.float32)


def check(model: Toy, n: int) -> None:
    x, pos = inputs(n)
    with torch.no_grad():
        torch.testing.assert_close(model(x, pos),
                                   model._vllm_compile_state.original_forward(model, x, pos))


def pieces(model: Toy) -> list[PiecewiseBackend]:
    split_gm = model._vllm_compile_state.vllm_backend.split_gm
    runnables = [v for k, v in split_gm.__dict__.items() if k.startswith("submod_")]
    runnables = [r.runnable if isinstance(r, CUDAGraphWrapper) else r for r in runnables]
    return [r for r in runnables if isinstance(r, PiecewiseBackend)]


def test_split_graph_gives_each_splitting_op_its_own_piece(caplog):
    def fn(x):
        out = torch.empty_like(x)
        torch.ops.silly_piecewise.attention(x, x, x, out)
        y = out.sin()
        out2 = torch.empty_like(y)
        torch.ops.silly_piecewise.attention(y, y, y, out2)
        return out2.cos()

    gm = torch.fx.symbolic_trace(fn)
    split_gm, items = split_graph(gm, [SILLY_OP])
    assert [i.is_splitting for i in items] == [False, True, False, True, False]
    assert [i.index for i in items] == [0, 1, 2, 3, 4]
    x = torch.randn(3, 2)
    torch.testing.assert_close(split_gm(x), fn(x))
    # Matching by overload name works too; unknown names split nothing.
    assert len(split_graph(gm, [SILLY_OP + ".default"])[1]) == 5
    assert "match no call" not in caplog.text
    # An entry matching nothing (a misspelt name) is warned about, by name.
    assert len(split_graph(gm, [SILLY_OP, "other::op"])[1]) == 5
    assert "splitting_ops ['other::op'] match no call in the traced graph" in caplog.text


def test_splitting_pieces_call_a_registered_eager_impl_directly(monkeypatch):
    """A splitting op with a registered Python implementation (the attention op) is called
    without the dispatcher's round trip; others run through it as traced."""
    from vllm.compilation import split

    direct_calls = []

    def direct(q, k, v, out):
        direct_calls.append(q.shape[0])
        silly_attention(q, k, v, out)

    monkeypatch.setitem(split._EAGER_IMPLS, SILLY_OP, direct)
    model = build(num_attn=2)
    check(model, 5)  # the trace itself runs the op through the dispatcher (fake/real)
    direct_calls.clear()
    check(model, 3)
    assert direct_calls == [3, 3]
    # The attention op is registered so.
    import vllm.attention.layer as attention

    assert split._EAGER_IMPLS[attention.ATTENTION_OP_NAME] is \
        attention.unified_attention_with_output


def test_compile_sizes_add_static_compiles_used_for_those_sizes(cpu_platform):
    model = build(compile_sizes=[4, 6])
    # The first call compiles every piece for the range and, statically, for each size.
    with compilation_counter.expect(num_backend_compilations=3 * 3, num_recompiles=0):
        check(model, 5)
    with compilation_counter.expect(num_backend_compilations=0):
        check(model, 4)
        check(model, 7)
        check(model, 6)
    for piece in pieces(model):
        assert sorted(piece.size_runnables) == [4, 6]
        args = (torch.randn(4, 4),) * 3
        assert piece.runnable_for(4, args) is piece.size_runnables[4]
        assert piece.runnable_for(5, args) is piece.range_runnables[Range(1, 2048)]


def test_compile_ranges_compile_each_range_and_dispatch_by_token_count(cpu_platform):
    assert compile_ranges([8, 32], 2048) == [Range(1, 8), Range(9, 32), Range(33, 2048)]
    assert compile_ranges([1, 4096, 8], 64) == [Range(1, 8), Range(9, 64)]
    model = build(compile_ranges_endpoints=[8, 32], compile_sizes=[16])
    with compilation_counter.expect(num_backend_compilations=3 * (3 + 1)):
        check(model, 3)
    with compilation_counter.expect(num_backend_compilations=0):
        for n in (8, 9, 32, 33, 16):
            check(model, n)
    assert len(pieces(model)) == 3
    piece = pieces(model)[0]
    assert set(piece.range_runnables) == {Range(1, 8), Range(9, 32), Range(33, 2048)}
    args = (torch.randn(20, 4),)
    assert piece.runnable_for(20, args) is piece.range_runnables[Range(9, 32)]
    assert piece.runnable_for(16, args) is piece.size_runnables[16]


def test_piecewise_cuda_graphs_capture_each_piece_once_per_size():
    config = VllmConfig(optimization_level=1, compilation_config=CompilationConfig(
        backend="eager", splitting_ops=[SILLY_OP]))
    # The CPU platform resolves NONE; force what a CUDA platform would use.
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    with set_current_vllm_config(config):
        model = Toy(2)
    buffers = inputs(8)  # persistent max-size buffers, as the model runner keeps
    with override_graph_factory(FakeCUDAGraph), torch.no_grad():
        # Warm-up (compiles) without graphs.
        with set_forward_context(None, config):
            model(buffers[0][:8], buffers[1][:8])
        with compilation_counter.expect(num_cudagraph_captured=3, num_cudagraph_replayed=6):
            for _ in range(3):
                with set_forward_context(None, config,
                                         cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                                         batch_descriptor=BatchDescriptor(4)):
                    buffers[0][:4].normal_()
                    out = model(buffers[0][:4], buffers[1][:4])
                    expected = model._vllm_compile_state.original_forward(
                        model, buffers[0][:4], buffers[1][:4])
                    torch.testing.assert_close(out, expected)
    split_gm = model._vllm_compile_state.vllm_backend.split_gm
    wrappers = [v for k, v in split_gm.__dict__.items() if isinstance(v, CUDAGraphWrapper)]
    assert len(wrappers) == 3  # the attention pieces are not wrapped
    assert all(list(w.entries) == [BatchDescriptor(4)] for w in wrappers)
